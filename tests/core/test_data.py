"""Streaming dataset validation: formats, every problem code at its exact line, chunk boundaries."""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from core.data.examples import read_examples
from core.data.stats import DuplicateCounter
from core.data.validate import DatasetReport, DatasetValidator, validate_file
from core.errors import InvalidInput

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LIMITS: dict[str, Any] = {"max_line_bytes": 1 << 20, "min_examples": 1, "max_problems": 50}

INSTR = b'{"instruction": "Add 2 and 3.", "input": "", "output": "5"}'
CHAT = b'{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}'


def jsonl(*lines: bytes | dict[str, Any]) -> bytes:
    return b"".join((ln if isinstance(ln, bytes) else json.dumps(ln).encode()) + b"\n" for ln in lines)


def feed(data: bytes, chunk: int | None = None, **kwargs: Any) -> DatasetReport:
    v = DatasetValidator(**{**LIMITS, **kwargs})
    step = chunk or max(1, len(data))
    for i in range(0, len(data), step):
        v.feed(data[i : i + step])
    return v.finish()


def report(data: bytes, tmp_path: Path | None = None, **kwargs: Any) -> DatasetReport:
    """The report, after checking that 1-byte, 7-byte and whole-file feeding (and the file) agree."""
    whole = feed(data, None, **kwargs)
    assert feed(data, 1, **kwargs) == whole
    assert feed(data, 7, **kwargs) == whole
    if tmp_path is not None:
        path = tmp_path / "data.jsonl"
        path.write_bytes(data)
        assert validate_file(path, **{**LIMITS, **kwargs}) == whole
    return whole


# ---- valid files, one per format


def test_chat(tmp_path: Path) -> None:
    data = jsonl(
        CHAT,
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris.", "weight": 1},
                {"role": "user", "content": "And of Italy?"},
                {"role": "assistant", "content": "Rome.", "weight": 0},
            ],
            "id": "extra keys are ignored",
        },
    )
    r = report(data, tmp_path)
    assert r.valid and r.format == "chat" and r.problems == [] and r.problem_counts == {}
    assert (r.num_examples, r.num_lines, r.duplicates) == (2, 2, 0)
    assert r.stats["messages_per_example"] == {"min": 2, "mean": 3.5, "p50": 5, "p95": 5, "max": 5}
    assert r.stats["with_system_message"] == 1
    assert r.size_bytes == len(data) and r.sha256 == hashlib.sha256(data).hexdigest()


def test_instruction(tmp_path: Path) -> None:
    data = jsonl(
        INSTR,
        {"instruction": "Reverse the word.", "input": "cat", "output": "tac"},
        {"instruction": "Name a colour.", "output": "Blue."},
        {"instruction": "Say yes.", "input": None, "output": "Yes."},  # null input is an absent input
    )
    r = report(data, tmp_path)
    assert r.valid and r.format == "instruction" and r.num_examples == 4
    assert r.stats["with_input"] == 1


def test_prompt_completion(tmp_path: Path) -> None:
    data = jsonl({"prompt": "2 + 2 =", "completion": " 4"}, {"prompt": "Sky colour:", "completion": " blue"})
    r = report(data, tmp_path)
    assert r.valid and r.format == "prompt_completion" and r.num_examples == 2


def test_text(tmp_path: Path) -> None:
    data = jsonl({"text": "abc"}, {"text": "hello world"}, {"text": "x" * 100})
    r = report(data, tmp_path)
    assert r.valid and r.format == "text" and r.num_examples == 3
    assert r.stats["chars_per_example"] == {"min": 3, "mean": 38.0, "p50": 11, "p95": 100, "max": 100}
    assert "messages_per_example" not in r.stats


def test_bom_crlf_blank_lines_and_no_final_newline(tmp_path: Path) -> None:
    data = (
        b"\xef\xbb\xbf"
        + INSTR
        + b"\r\n\r\n   \r\n"
        + INSTR.replace(b"5", b"five")
        + b"\r\n\n"
        + INSTR[:-1]
        + b"}"
    )
    r = report(data, tmp_path)
    assert r.valid, r.problems
    assert (r.num_examples, r.num_lines, r.stats["blank_lines"]) == (3, 6, 3)
    path = tmp_path / "data.jsonl"  # the trainer reads the same file the same way
    assert [e.messages[1].content for e in read_examples(path)] == ["5", "five", "5"]


def test_empty_file_is_too_few_examples() -> None:
    r = report(b"")
    assert not r.valid and r.format is None and r.num_lines == 0
    assert r.problem_counts == {"too_few_examples": 1}
    assert report(b"", min_examples=0).valid


# ---- every problem code, at its exact line

CASES: dict[str, tuple[list[bytes], int, str | None, dict[str, Any]]] = {
    "invalid_json": ([INSTR, b"", b'{"instruction": "a",'], 3, None, {}),
    "not_an_object": ([INSTR, b"[1, 2]"], 2, None, {}),
    "unknown_format": ([b"", b'{"question": "q", "answer": "a"}', INSTR], 2, None, {}),
    "mixed_formats": ([INSTR, INSTR, b'{"text": "hello"}'], 3, None, {}),
    "missing_field": ([INSTR, b'{"instruction": "Say hi."}'], 2, "output", {}),
    "wrong_type": ([INSTR, b"", b'{"instruction": "Say hi.", "output": 5}'], 3, "output", {}),
    "empty_content": ([INSTR, b'{"instruction": "Say hi.", "output": " \\n "}'], 2, "output", {}),
    "unknown_role": (
        [
            CHAT,
            b"",
            b"",
            CHAT,
            b"",
            CHAT,
            b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, '
            b'{"role": "bot", "content": "c"}]}',
        ],
        7,
        "messages[2].role",
        {},
    ),
    "no_assistant_turn": ([CHAT, b'{"messages": [{"role": "user", "content": "Hi"}]}'], 2, "messages", {}),
    "roles_not_alternating": (
        [
            CHAT,
            b'{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, '
            b'{"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]}',
        ],
        2,
        "messages[2].role",
        {},
    ),
    "invalid_utf8": ([INSTR, b'{"instruction": "caf\xe9", "output": "x"}'], 2, None, {}),
    "line_too_long": ([INSTR, b'{"text": "' + b"a" * 200 + b'"}', INSTR], 2, None, {"max_line_bytes": 100}),
    "too_few_examples": ([INSTR, b"{}"], 0, None, {"min_examples": 2}),
}


@pytest.mark.parametrize("code", sorted(CASES))
def test_problem_code_and_line(code: str, tmp_path: Path) -> None:
    lines, line, field, kwargs = CASES[code]
    r = report(jsonl(*lines), tmp_path, **kwargs)
    assert not r.valid
    found = [p for p in r.problems if p.code == code]
    assert len(found) == 1 and r.problem_counts[code] == 1, r.problems
    assert (found[0].line, found[0].field) == (line, field)
    prefix = "file:" if line == 0 else f"line {line}:"
    assert found[0].message.startswith(prefix)


def test_messages_are_clear() -> None:
    r = report(jsonl(*CASES["unknown_role"][0]))
    assert r.problems[0].message == (
        'line 7: field "messages[2].role" must be one of system, user, assistant, tool, function; got "bot"'
    )
    r = report(jsonl(INSTR, b'{"instruction": "x", "output": ["y"]}'))
    assert r.problems[0].message == 'line 2: field "output" must be a string; got array'
    r = report(jsonl(INSTR, b'{"text": "t"}'))
    assert r.problems[0].message == (
        'line 2: format is "text" but the file\'s format is "instruction" (from line 1); '
        "a file must use one format"
    )
    r = report(jsonl(INSTR, b"x" * 150), max_line_bytes=100)
    assert r.problems[0].message == "line 2: is 150 bytes, over the limit of 100; skipped"


@pytest.mark.parametrize(
    ("line", "code", "field"),
    [
        (b'{"messages": {}}', "wrong_type", "messages"),
        (b'{"messages": []}', "empty_content", "messages"),
        (b'{"messages": ["hi"]}', "wrong_type", "messages[0]"),
        (b'{"messages": [{"content": "a"}]}', "missing_field", "messages[0].role"),
        (b'{"messages": [{"role": 1, "content": "a"}]}', "wrong_type", "messages[0].role"),
        (b'{"messages": [{"role": "user"}]}', "missing_field", "messages[0].content"),
        (b'{"messages": [{"role": "user", "content": ""}]}', "empty_content", "messages[0].content"),
        (
            b'{"messages": [{"role": "assistant", "content": "a"}]}',
            "roles_not_alternating",
            "messages[0].role",
        ),
        (
            b'{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}]}',
            "roles_not_alternating",
            "messages[1].role",
        ),
        (
            b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", '
            b'"weight": 2}]}',
            "wrong_type",
            "messages[1].weight",
        ),
        (
            b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", '
            b'"weight": true}]}',
            "wrong_type",
            "messages[1].weight",
        ),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "invalid_utf8", "messages[0].content"),
    ],
)
def test_chat_problems(line: bytes, code: str, field: str) -> None:
    r = report(jsonl(CHAT, line))
    assert [(p.line, p.code, p.field) for p in r.problems] == [(2, code, field)]


@pytest.mark.parametrize(
    ("line", "code", "field"),
    [
        (b'{"instruction": "a", "input": 3, "output": "b"}', "wrong_type", "input"),
        (b'{"instruction": "", "output": "b"}', "empty_content", "instruction"),
        (b'{"output": "b"}', "missing_field", "instruction"),
        (b'{"unrelated": 1}', "missing_field", "instruction"),  # the file's format says what is missing
        (b'{"prompt": "a", "completion": "b"}', "mixed_formats", None),
        (b'{"instruction": "a", "output": "\\udfff"}', "invalid_utf8", "output"),
        (b'"just a string"', "not_an_object", None),
        (b"[" * 100_000, "invalid_json", None),  # too deep for the parser: still a problem, not a crash
        (b"12", "not_an_object", None),
        (b'{"a": ' + b"1" * 5000 + b"}", "invalid_json", None),  # int digits over Python's limit
    ],
)
def test_instruction_problems(line: bytes, code: str, field: str | None) -> None:
    r = report(jsonl(INSTR, line))
    assert [(p.line, p.code, p.field) for p in r.problems] == [(2, code, field)]


def test_bom_only_at_file_start() -> None:
    r = report(jsonl(INSTR, b"\xef\xbb\xbf" + INSTR))
    assert [(p.line, p.code) for p in r.problems] == [(2, "invalid_json")]


def test_problem_list_is_capped_but_counts_are_whole() -> None:
    r = report(jsonl(INSTR, *[b"nope"] * 20, b"[]"), max_problems=5)
    assert [p.line for p in r.problems] == [2, 3, 4, 5, 6]
    assert r.problem_counts == {"invalid_json": 20, "not_an_object": 1}
    r = report(jsonl(*[b"nope"] * 20), max_problems=3)
    assert [(p.line, p.code) for p in r.problems] == [
        (0, "too_few_examples"),
        (1, "invalid_json"),
        (2, "invalid_json"),
    ]


# ---- long lines are skipped without being buffered


@pytest.mark.parametrize("chunk", [1, 7, 100, 101, 102, None])
def test_line_length_limit_is_exact(chunk: int | None) -> None:
    ok = b'{"text": "' + b"a" * 88 + b'"}'  # 100 bytes
    assert len(ok) == 100
    data = ok + b"\n" + ok + b"b\n" + ok + b"\r\n" + ok + b"bb"
    r = feed(data, chunk, max_line_bytes=100)
    assert [(p.line, p.code) for p in r.problems] == [
        (2, "line_too_long"),
        (3, "line_too_long"),
        (4, "line_too_long"),
    ]
    assert r.num_examples == 1 and r.num_lines == 4


def test_huge_line_uses_constant_memory() -> None:
    v = DatasetValidator(**{**LIMITS, "max_line_bytes": 1000})
    v.feed(INSTR + b"\n" + b'{"text": "')
    block = b"x" * (1 << 16)
    tracemalloc.start()
    try:
        for _ in range(320):  # 20 MiB in one line
            v.feed(block)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    v.feed(b'"}\n' + INSTR + b"\n")
    r = v.finish()
    assert peak < 256 * 1024, peak
    assert [(p.line, p.code) for p in r.problems] == [(2, "line_too_long")]
    assert f"is {10 + 320 * (1 << 16) + 2} bytes" in r.problems[0].message
    assert r.num_examples == 2 and r.num_lines == 3


# ---- duplicates, mapping, hashing, lifecycle


def test_duplicates_ignore_key_order_spacing_and_extra_keys() -> None:
    data = jsonl(
        INSTR,
        b'{"output": "5", "instruction": "Add 2 and 3.", "input": "", "id": 9}',
        b'{ "instruction":"Add 2 and 3.","output":"5" , "input":""}',
        b'{"instruction": "Add 2 and 3.", "output": "5"}',  # no input: same example as an empty one
        b'{"instruction": "Add 2 and 3.", "input": "", "output": "6"}',
    )
    r = report(data)
    assert r.valid and r.num_examples == 5 and r.duplicates == 3


def test_chat_duplicates_consider_weights() -> None:
    weighted = CHAT.replace(b'"Hello!"}', b'"Hello!", "weight": 0}')
    assert weighted != CHAT
    r = report(jsonl(CHAT, CHAT, weighted))
    assert r.duplicates == 1


@pytest.mark.parametrize("spill", [False, True])
def test_duplicate_counter_counts_repeats_of_earlier_hashes_once_each(spill: bool, tmp_path: Path) -> None:
    counter = DuplicateCounter(tmp_path if spill else None, max_in_memory=3)
    hashes = [5, -3, 5, 2**63 - 1, -(2**63), 5, -3, 0, 2**63 - 1, 7]
    for h in hashes:
        counter.add(h)
    assert [p.name.startswith("duplicates-") for p in tmp_path.iterdir()] == ([True] if spill else [])
    assert counter.count() == len(hashes) - len(set(hashes)) == 4
    assert counter.count() == 4  # counted and freed once; the answer is kept
    assert list(tmp_path.iterdir()) == []  # the spilled hashes are gone
    assert DuplicateCounter(tmp_path).count() == 0


def test_column_mapping(tmp_path: Path) -> None:
    mapping = {"question": "prompt", "answer": "completion"}
    data = jsonl({"question": "2 + 2?", "answer": "4"}, {"question": "3 + 3?", "answer": "6", "prompt": "x"})
    r = report(data, tmp_path, column_mapping=mapping)
    assert r.valid and r.format == "prompt_completion" and r.num_examples == 2
    examples = list(read_examples(tmp_path / "data.jsonl", column_mapping=mapping))
    assert [e.messages[0].content for e in examples] == ["2 + 2?", "3 + 3?"]
    # Problems name the user's own keys.
    r = report(jsonl({"question": "q", "answer": 4}), column_mapping=mapping, min_examples=0)
    assert (r.problems[0].field, r.problems[0].code) == ("answer", "wrong_type")
    assert r.problems[0].message.startswith('line 1: field "answer" must be a string')
    assert not report(data).valid  # without the mapping the keys mean nothing


def test_column_mapping_for_chat() -> None:
    line = {"conversation": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}
    r = report(jsonl(line), column_mapping={"conversation": "messages"}, min_examples=0)
    assert (r.problems[0].code, r.problems[0].field) == ("unknown_role", "conversation[1].role")


@pytest.mark.parametrize(
    "mapping", [{"q": "question"}, {"a": "prompt", "b": "prompt"}, {"": "text"}, {"a": 1}, ["a"]]
)
def test_bad_column_mapping_is_refused(mapping: Any) -> None:
    with pytest.raises(InvalidInput) as e:
        DatasetValidator(**LIMITS, column_mapping=mapping)
    assert e.value.param == "column_mapping"


def test_sha256_with_large_chunks_and_any_bytes_like() -> None:
    data = jsonl(*[{"text": f"example {i} " + "z" * (i % 500)} for i in range(3000)])
    assert len(data) > 4 * (1 << 16)  # chunks big enough to be hashed on the helper thread
    for chunk in (1 << 16, 100_000, None):
        r = feed(data, chunk)
        assert r.sha256 == hashlib.sha256(data).hexdigest() and r.num_examples == 3000 and r.valid
    v = DatasetValidator(**LIMITS)
    for i in range(0, len(data), 1 << 17):
        v.feed(memoryview(bytearray(data[i : i + (1 << 17)])))
    assert v.finish() == feed(data)


def test_finish_is_idempotent_and_ends_feeding() -> None:
    v = DatasetValidator(**LIMITS)
    v.feed(INSTR)  # no final newline: validated at finish
    first = v.finish()
    assert first.num_examples == 1 and v.finish() == first
    with pytest.raises(RuntimeError):
        v.feed(b"more")


def test_stats_percentiles_stay_bounded_for_many_examples() -> None:
    data = jsonl(*[{"text": "x" * (1 + i % 1000)} for i in range(12_000)])
    r = feed(data)
    chars = r.stats["chars_per_example"]
    assert r.stats["percentiles_exact"] is False
    assert (chars["min"], chars["max"], chars["mean"]) == (1, 1000, 500.5)
    assert 450 <= chars["p50"] <= 550 and 925 <= chars["p95"] <= 975
    assert feed(data) == r  # fixed seed: the same file gives the same report


# ---- the shipped example files


@pytest.mark.parametrize(
    ("name", "fmt", "at_least"), [("alpaca_small", "instruction", 180), ("chat_small", "chat", 90)]
)
def test_example_files_are_valid(name: str, fmt: str, at_least: int) -> None:
    path = EXAMPLES / f"{name}.jsonl"
    r = validate_file(path, **LIMITS)
    assert r.valid, r.problems[:3]
    assert r.format == fmt and r.num_examples >= at_least and r.duplicates == 0
    examples = list(read_examples(path))
    assert len(examples) == r.num_examples
    assert all(e.messages[-1].role == "assistant" and e.messages[-1].content for e in examples)
