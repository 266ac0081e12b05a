"""Properties of streaming validation (hypothesis): random bytes and JSON never raise, chunking never
changes the report, and whatever passes is what the trainer reads back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from core.data.examples import read_examples
from core.data.stats import DuplicateCounter
from core.data.validate import DatasetReport, DatasetValidator
from tests.core.test_data import LIMITS, feed, jsonl

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
# Values shaped like the formats, so the deeper checks are reached too.
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "bot"]) | json_values},
        optional={
            "content": st.text(max_size=8) | json_values,
            "weight": st.sampled_from([0, 1, 2, True, None]),
        },
    ),
    max_size=5,
)
objects = st.one_of(
    st.fixed_dictionaries({"messages": messages | json_values}),
    st.fixed_dictionaries(
        {}, optional={k: st.text(max_size=8) | json_values for k in ("instruction", "input", "output")}
    ),
    st.fixed_dictionaries(
        {}, optional={k: st.text(max_size=8) | json_values for k in ("prompt", "completion", "text")}
    ),
    json_values,
)
lines = st.lists(st.one_of(objects.map(lambda o: json.dumps(o).encode()), st.binary(max_size=30)), max_size=8)
chunkings = st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=6)


def feed_chunked(data: bytes, sizes: list[int], **kwargs: Any) -> DatasetReport:
    v = DatasetValidator(**{**LIMITS, **kwargs})
    i = 0
    for n in sizes * (len(data) // max(1, sum(sizes)) + 1):
        v.feed(data[i : i + n])
        i += n
    v.feed(data[i:])
    return v.finish()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=300), sizes=chunkings, max_line=st.integers(0, 50))
def test_random_bytes_never_raise(data: bytes, sizes: list[int], max_line: int) -> None:
    r = feed_chunked(data, sizes, max_line_bytes=max_line, max_problems=3)
    assert isinstance(r, DatasetReport) and r.size_bytes == len(data)
    assert r == feed(data, None, max_line_bytes=max_line, max_problems=3)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lines=lines,
    sep=st.sampled_from([b"\n", b"\r\n", b"\n\n"]),
    sizes=chunkings,
    mapping=st.sampled_from([None, {"q": "prompt", "a": "completion"}]),
)
def test_random_json_never_raises(
    lines: list[bytes], sep: bytes, sizes: list[int], mapping: dict[str, str] | None
) -> None:
    data = sep.join(lines)
    r = feed_chunked(data, sizes, column_mapping=mapping)
    assert isinstance(r, DatasetReport)
    assert r == feed(data, None, column_mapping=mapping)
    assert r.valid == (not r.problems) and sum(r.problem_counts.values()) >= len(r.problems)
    assert all(p.line <= r.num_lines for p in r.problems)


nonblank = st.text(min_size=1, max_size=10).filter(lambda t: not t.isspace())
chat_lines = st.builds(
    lambda system, turns: {
        "messages": ([{"role": "system", "content": system}] if system else [])
        + [m for u, a in turns for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})]
    },
    st.none() | nonblank,
    st.lists(st.tuples(nonblank, nonblank), min_size=1, max_size=3),
)
instruction_lines = st.fixed_dictionaries(
    {"instruction": nonblank, "output": nonblank}, optional={"input": st.text(max_size=5), "id": json_values}
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    hashes=st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-3, 3), max_size=60),
    bound=st.integers(1, 9),
)
def test_duplicate_counts_spilled_or_not_are_exact(hashes: list[int], bound: int, tmp_path: Path) -> None:
    spilling, in_memory = DuplicateCounter(tmp_path, max_in_memory=bound), DuplicateCounter()
    for h in hashes:
        spilling.add(h)
        in_memory.add(h)
    assert spilling.count() == in_memory.count() == len(hashes) - len(set(hashes))


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(chat_lines, min_size=1, max_size=6) | st.lists(instruction_lines, min_size=1, max_size=6)
)
def test_well_formed_files_pass_and_read_back(rows: list[dict[str, Any]], tmp_path_factory: Any) -> None:
    data = jsonl(*rows)
    r = feed_chunked(data, [3])
    assert r.valid and r.num_examples == len(rows), r.problems
    path = tmp_path_factory.mktemp("d") / "data.jsonl"
    path.write_bytes(data)
    examples = list(read_examples(path))
    assert [e.messages[-1].content for e in examples] == [
        row["messages"][-1]["content"] if "messages" in row else row["output"] for row in rows
    ]


@settings(max_examples=100, deadline=None)
@given(lines=lines)
@example(lines=[b"\xef\xbb\xbf"])  # a file of only a byte-order mark: valid with min_examples=0
def test_whatever_passes_is_readable_by_the_trainer(lines: list[bytes], tmp_path_factory: Any) -> None:
    data = b"\n".join(lines)
    r = feed(data, None, min_examples=0)
    if r.valid:
        path = tmp_path_factory.mktemp("d") / "data.jsonl"
        path.write_bytes(data)
        assert len(list(read_examples(path))) == r.num_examples
