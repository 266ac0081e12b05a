"""Preference datasets (objective dpo): OpenAI's and TRL's formats validated while streaming, every problem
at its line with a stable code; the report's kind; the spec's DPO fields; the planner's DPO terms."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from core.data.examples import kind_of, read_examples, read_preferences
from core.data.token_stats import TokenStats, summary
from core.data.validate import DatasetReport, DatasetValidator, validate_file
from core.spec import JobSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LIMITS: dict[str, Any] = {"max_line_bytes": 1 << 20, "min_examples": 1, "max_problems": 50}
USER = [{"role": "user", "content": "Capital of France?"}]
GOOD = [{"role": "assistant", "content": "Paris."}]
BAD = [{"role": "assistant", "content": "Lyon."}]
OPENAI = {"input": {"messages": USER}, "preferred_output": GOOD, "non_preferred_output": BAD}


def jsonl(*rows: dict[str, Any] | bytes) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def report(data: bytes, tmp_path: Path | None = None) -> DatasetReport:
    def feed(chunk: int | None) -> DatasetReport:
        v = DatasetValidator(**LIMITS)
        step = chunk or len(data)
        for i in range(0, len(data), step):
            v.feed(data[i : i + step])
        return v.finish()

    whole = feed(None)
    assert feed(1) == whole and feed(7) == whole
    if tmp_path is not None:
        (tmp_path / "d.jsonl").write_bytes(data)
        assert validate_file(tmp_path / "d.jsonl", **LIMITS) == whole
    return whole


def problems(r: DatasetReport) -> list[tuple[int, str, str | None]]:
    return [(p.line, p.code, p.field) for p in r.problems]


def test_openai_preference_format(tmp_path: Path) -> None:
    multi = {
        "input": {
            "messages": [
                {"role": "system", "content": "Be brief."},
                *USER,
                *GOOD,
                {"role": "user", "content": "And of Italy?"},
            ],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        },
        "preferred_output": [{"role": "assistant", "content": "Rome."}],
        "non_preferred_output": [{"role": "assistant", "content": "Milan."}],
    }
    r = report(jsonl(OPENAI, multi), tmp_path)
    assert r.valid and r.format == "preference" and r.kind == "preference" and r.num_examples == 2
    pairs = list(read_preferences(tmp_path / "d.jsonl"))
    assert [len(p.prompt) for p in pairs] == [1, 4] and pairs[1].tools is not None
    assert (pairs[1].chosen.content, pairs[1].rejected.content) == ("Rome.", "Milan.")
    assert all(p.conversational for p in pairs)


def test_trl_formats(tmp_path: Path) -> None:
    for rows, conversational, implicit in [
        ([{"prompt": USER, "chosen": GOOD, "rejected": BAD}], True, 0),
        ([{"chosen": USER + GOOD, "rejected": USER + BAD}], True, 1),
        ([{"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}], False, 0),
        ([{"chosen": "2 + 2 = 4", "rejected": "2 + 2 = 5"}], False, 1),
    ]:
        r = report(jsonl(*rows), tmp_path)
        assert r.valid and r.format == "chosen_rejected" and r.kind == "preference", rows
        assert r.stats["with_implicit_prompt"] == implicit
        (pair,) = read_preferences(tmp_path / "d.jsonl")
        assert pair.conversational is conversational
    (pair,) = read_preferences(tmp_path / "d.jsonl")
    assert (pair.prompt[0].content, pair.chosen.content, pair.rejected.content) == ("2 + 2 =", " 4", " 5")


def test_kinds() -> None:
    assert [kind_of(f) for f in ("chat", "text", "preference", "chosen_rejected", None)] == [
        "sft", "sft", "preference", "preference", None,
    ]  # fmt: skip
    r = report(jsonl({"messages": USER + GOOD}))
    assert r.kind == "sft"


def test_reading_a_file_as_the_other_kind_is_refused(tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_bytes(jsonl(OPENAI))
    with pytest.raises(ValueError, match="objective 'dpo'"):
        list(read_examples(tmp_path / "p.jsonl"))
    (tmp_path / "s.jsonl").write_bytes(jsonl({"messages": USER + GOOD}))
    with pytest.raises(ValueError, match="objective 'sft'"):
        list(read_preferences(tmp_path / "s.jsonl"))


def test_every_problem_at_its_line() -> None:
    data = jsonl(
        OPENAI,  # 1: fine
        {**OPENAI, "preferred_output": [{"role": "user", "content": "x"}]},  # 2
        {"input": {"messages": USER}, "preferred_output": GOOD},  # 3
        {**OPENAI, "input": {"messages": USER + GOOD}},  # 4: the prompt ends with the assistant
        {**OPENAI, "input": {"messages": [{"role": "user", "content": " "}]}},  # 5
        {**OPENAI, "non_preferred_output": GOOD},  # 6: nothing to prefer
        {**OPENAI, "preferred_output": GOOD + GOOD},  # 7: two replies
        {**OPENAI, "input": "hi"},  # 8
        {**OPENAI, "input": {"messages": [{"role": "bot", "content": "x"}]}},  # 9
        {**OPENAI, "input": {"messages": USER, "tools": "f"}},  # 10
        b"",  # 11: blank
        {"prompt": USER, "chosen": GOOD, "rejected": BAD},  # 12: another format
        {**OPENAI, "preferred_output": [{"role": "assistant", "content": 3}]},  # 13
    )
    r = report(data)
    assert not r.valid and r.num_examples == 1
    assert problems(r) == [
        (2, "wrong_role", "preferred_output[0].role"),
        (3, "missing_field", "non_preferred_output"),
        (4, "roles_not_alternating", "input.messages[1].role"),
        (5, "empty_content", "input.messages[0].content"),
        (6, "identical_replies", "non_preferred_output"),
        (7, "wrong_type", "preferred_output"),
        (8, "wrong_type", "input"),
        (9, "unknown_role", "input.messages[0].role"),
        (10, "wrong_type", "input.tools"),
        (12, "mixed_formats", None),
        (13, "wrong_type", "preferred_output[0].content"),
    ]
    assert r.problems[0].message.startswith('line 2: field "preferred_output[0].role"')


def test_trl_problems_at_their_lines() -> None:
    data = jsonl(
        {"prompt": USER, "chosen": GOOD, "rejected": BAD},  # 1: fine
        {"prompt": USER, "chosen": GOOD},  # 2
        {"prompt": "text", "chosen": GOOD, "rejected": BAD},  # 3: a string prompt with message replies
        {"chosen": USER + GOOD, "rejected": [{"role": "user", "content": "Other?"}, *BAD]},  # 4
        {"chosen": USER + GOOD, "rejected": USER + GOOD},  # 5
        {"prompt": USER, "chosen": "Paris.", "rejected": BAD},  # 6: chosen a string, rejected not
        {"chosen": 3, "rejected": 4},  # 7
        {"prompt": USER, "chosen": GOOD, "rejected": [{"role": "assistant", "content": ""}]},  # 8
        {"chosen": USER, "rejected": USER + BAD},  # 9: chosen has no reply
    )
    r = report(data)
    assert problems(r) == [
        (2, "missing_field", "rejected"),
        (3, "wrong_type", "prompt"),
        (4, "no_common_prompt", "rejected"),
        (5, "identical_replies", "rejected"),
        (6, "wrong_type", "rejected"),
        (7, "wrong_type", "chosen"),
        (8, "empty_content", "rejected[0].content"),
        (9, "roles_not_alternating", "chosen[0].role"),
    ]


def test_a_column_mapping_renames_into_preference_fields(tmp_path: Path) -> None:
    data = jsonl({"question": "2 + 2 =", "good": " 4", "bad": " 5"})
    mapping = {"question": "prompt", "good": "chosen", "bad": "rejected"}
    v = DatasetValidator(**LIMITS, column_mapping=mapping)
    v.feed(data)
    r = v.finish()
    assert r.valid and r.format == "chosen_rejected"
    (tmp_path / "m.jsonl").write_bytes(data)
    (pair,) = read_preferences(tmp_path / "m.jsonl", mapping)
    assert pair.chosen.content == " 4"


def test_duplicates_count_the_same_pair() -> None:
    other = {**OPENAI, "non_preferred_output": [{"role": "assistant", "content": "Nice."}]}
    r = report(jsonl(OPENAI, {**OPENAI, "id": 7}, other))
    assert r.duplicates == 1


def test_the_shipped_example_is_valid() -> None:
    r = validate_file(EXAMPLES / "preference_small.jsonl", **LIMITS)
    assert r.valid and r.kind == "preference" and r.num_examples >= 50


# ---- the spec


def spec(**kw: Any) -> JobSpec:
    return JobSpec(base_model="ftune-demo", dataset_id="dataset0001", **kw)


def test_dpo_fields() -> None:
    s = spec(
        objective="dpo", beta=0.2, loss_type="simpo", simpo_gamma=1.0, rpo_alpha=0.5, init_from="job0000001"
    )
    assert (s.uses_reference, s.sequences_per_example) == (False, 2)
    assert spec(objective="dpo").uses_reference and not spec().uses_reference
    assert JobSpec.model_validate_json(s.model_dump_json()) == s  # read back, every field set
    for bad, words in [
        ({"beta": 0.3}, "apply to objectives 'dpo' and 'grpo' only"),
        ({"rpo_alpha": 1.0}, "apply to objective 'dpo' only"),
        ({"objective": "dpo", "train_on_inputs": True}, "train_on_inputs"),
        ({"objective": "dpo", "simpo_gamma": 2.0}, "simpo_gamma applies to loss_type 'simpo'"),
        ({"objective": "dpo", "beta": 0}, "greater than 0"),
        ({"objective": "ppo"}, "objective"),
        ({"init_from": "../x"}, "earlier job"),
    ]:
        with pytest.raises(ValidationError, match=words):
            spec(**bad)


# ---- token statistics and the planner


def test_token_stats_summary_of_pairs() -> None:
    stats = TokenStats.model_validate(
        {
            "status": "ready",
            "count": 10,
            "p50": 60,
            "p95": 70,
            "max": 73,
            "max_seq_len": 64,
            "over_max_seq_len": 3,
            "over_length": "truncate",
            "dropped": 0,
            "kind": "preference",
            "prompt_p50": 24,
            "prompt_p95": 30,
            "prompt_max": 31,
            "completion_p50": 35,
            "completion_p95": 40,
            "completion_max": 42,
            "truncated": 3,
        }
    )
    text = summary(stats)
    assert text.startswith("warning: token statistics: 10 preference pairs")
    assert "3 exceed max_seq_len 64 and will be truncated (the prompt first, then the replies)" in text
    assert stats.truncated == 3 and stats.prompt_max == 31


def test_the_planner_counts_both_sides_and_the_reference() -> None:
    from core.arch import from_config
    from planner import estimate
    from planner.gpus import resolve_gpu

    arch = from_config(
        {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16"}
    )  # fmt: skip
    gpu = resolve_gpu("A100-80GB")

    def plan(**kw: Any):
        return estimate(spec(method="qlora", max_seq_len=1024, **kw), arch, gpu, suggest=False)

    sft2, sft4 = plan(micro_batch_size=2), plan(micro_batch_size=4)
    dpo, simpo = (
        plan(micro_batch_size=2, objective="dpo"),
        plan(micro_batch_size=2, objective="dpo", loss_type="simpo"),
    )
    names = {t.name for t in dpo.breakdown}
    assert {"reference log-probs", "reference forward (no activations kept)"} <= names
    assert "reference forward (no activations kept)" not in {t.name for t in simpo.breakdown}

    def term(p, name: str) -> int:
        return next(t.bytes for t in p.breakdown if t.name == name)

    # two sequences a pair: 2 pairs hold the activations and logits of 4 SFT examples
    assert term(dpo, "activations") == term(sft4, "activations") == 2 * term(sft2, "activations")
    assert term(dpo, "logits and loss") == term(sft4, "logits and loss")
    assert dpo.allocated_bytes == sft4.allocated_bytes + term(dpo, "reference log-probs")
    assert term(dpo, "reference forward (no activations kept)") == 0  # not the peak: listed, at 0
    timed = [estimate(p, arch, gpu, 10**6, suggest=False).est_seconds_per_epoch for p in (
        spec(objective="dpo"), spec(objective="dpo", loss_type="simpo"))]  # fmt: skip
    assert timed[0] > timed[1]  # the reference forward costs time, not peak memory
