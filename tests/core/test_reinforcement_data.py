"""The reinforcement dataset format (OpenAI's RFT rows) and objective grpo's spec fields."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from core.data.examples import read_examples, read_prompts
from core.data.validate import DatasetValidator, validate_file
from core.spec import JobSpec
from graders import GraderError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LIMITS: dict[str, Any] = {"max_line_bytes": 1 << 20, "min_examples": 1, "max_problems": 50}
ROW = {"messages": [{"role": "user", "content": "Capital of France?"}], "answer": "Paris", "meta": {"n": 1}}
GRADER = {"type": "string_check", "name": "s", "operation": "eq"}
GRADER |= {"input": "{{sample.output_text}}", "reference": "{{item.answer}}"}


def report(*rows: Any):
    v = DatasetValidator(**LIMITS)
    v.feed("".join(json.dumps(r) + "\n" for r in rows).encode())
    return v.finish()


def test_the_shipped_example_is_a_valid_reinforcement_file(tmp_path: Path) -> None:
    r = validate_file(EXAMPLES / "rft_small.jsonl", **LIMITS)
    assert r.valid and r.format == "reinforcement" and r.kind == "reinforcement" and r.num_examples >= 50
    first = next(read_prompts(EXAMPLES / "rft_small.jsonl"))
    assert first.prompt[-1].role == "user" and "answer" in first.item and "messages" in first.item


def test_rows_end_in_a_user_turn_and_keep_every_key(tmp_path: Path) -> None:
    roles = ("system", "user", "assistant", "user")
    multi_turn = {"messages": [{"role": r, "content": f"turn {i}"} for i, r in enumerate(roles)]}
    r = report(ROW, multi_turn)
    assert r.valid and r.kind == "reinforcement", r.problems
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROW) + "\n")
    (p,) = read_prompts(path)
    assert p.item == ROW and [m.content for m in p.prompt] == ["Capital of France?"]
    with pytest.raises(ValueError, match="objective 'grpo'"):
        list(read_examples(path))


def test_problems_have_line_numbers_and_a_chat_file_keeps_no_assistant_turn() -> None:
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    r = report(ROW, chat, {"messages": [{"role": "user", "content": 3}]})
    codes = [(p.line, p.code) for p in r.problems]
    assert codes == [(2, "mixed_formats"), (3, "wrong_type")]
    r = report(chat, ROW)  # in a chat file a line ending in a user turn lacks its reply
    assert [(p.line, p.code) for p in r.problems] == [(2, "no_assistant_turn")]


def spec(**kw: Any) -> JobSpec:
    return JobSpec(base_model="ftune-demo", dataset_id="dataset0001", **kw)


def test_grpo_defaults_are_trls_and_sft_refuses_grpo_fields() -> None:
    s = spec(objective="grpo", grader=GRADER)
    assert (s.beta, s.loss_type, s.epsilon, s.epsilon_high, s.scale_rewards) == (
        0.0,
        "dapo",
        0.2,
        None,
        "group",
    )
    assert s.sequences_per_example == s.num_generations == 4 and not s.uses_reference
    assert spec(objective="grpo", grader=GRADER, beta=0.04).uses_reference
    assert not s.batch.packing  # a step's rows are prompts
    with pytest.raises(ValidationError, match="num_generations apply to objective 'grpo' only"):
        spec(num_generations=8)
    with pytest.raises(ValidationError, match="rollout_batch_size apply to objective 'grpo' only"):
        spec(rollout_batch_size=2)
    # a step's prompts are sampled together unless rollout_batch_size says fewer
    step = dict(objective="grpo", grader=GRADER, micro_batch_size=2, gradient_accumulation_steps=3)
    assert (s.rl.rollout_prompts, spec(**step).rl.rollout_prompts) == (4, 6)
    assert spec(**step, rollout_batch_size=4).rl.rollout_sequences == 4 * 4
    assert spec(**step, rollout_batch_size=64).rl.rollout_prompts == 6
    with pytest.raises(ValidationError, match="needs a grader"):
        spec(objective="grpo")
    with pytest.raises(ValidationError, match="loss_type for objective 'grpo'"):
        spec(objective="grpo", grader=GRADER, loss_type="sigmoid")
    with pytest.raises(ValidationError, match="loss_type for objective 'dpo'"):
        spec(objective="dpo", loss_type="dapo")
    with pytest.raises(ValidationError, match="leaves under 8 tokens"):
        spec(objective="grpo", grader=GRADER, max_seq_len=64, max_completion_tokens=60)


def test_a_bad_grader_names_its_field() -> None:
    with pytest.raises(GraderError) as e:
        spec(objective="grpo", grader={**GRADER, "operation": "contains"})
    assert e.value.param == "grader.operation"
    round_trip = JobSpec.model_validate(spec(objective="grpo", grader=GRADER).model_dump(mode="json"))
    assert round_trip.grader == spec(objective="grpo", grader=GRADER).grader
