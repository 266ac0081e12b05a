"""JobSpec's before/after sample fields, and the samples records across a resume (core.run_protocol)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from core.run_protocol import SampleItem, SamplesRecord, StartRecord, encode, latest_samples, read_records
from core.spec import JobSpec

BASE = {"base_model": "tiny", "dataset_id": "abcdefgh12"}
USER = {"role": "user", "content": "Hi?"}


def error(**fields: Any) -> tuple[tuple[Any, ...], str]:
    with pytest.raises(ValidationError) as e:
        JobSpec(**BASE, **fields)
    (err,) = e.value.errors()
    return err["loc"], err["msg"]


def test_defaults_take_no_samples() -> None:
    spec = JobSpec(**BASE)
    assert (spec.sample_prompts, spec.sample_max_tokens, spec.sample_at_eval) == (0, 64, False)


def test_a_number_or_a_list_of_strings_and_chats_round_trips() -> None:
    chat = [{"role": "system", "content": "Be brief."}, USER]
    spec = JobSpec(**BASE, sample_prompts=["Why?", chat], sample_max_tokens=512)
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec
    assert spec.model_dump(mode="json")["sample_prompts"] == ["Why?", chat]
    assert JobSpec(**BASE, sample_prompts=32).sample_prompts == 32


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (33, "a number of prompts must be 0-32"),
        (-1, "a number of prompts must be 0-32"),
        (True, "must be a number of prompts (0-32) or a list of prompts"),
        ("Why?", "must be a number of prompts (0-32) or a list of prompts"),
        (2.5, "must be a number of prompts (0-32) or a list of prompts"),
        ([], "a list must hold 1-32 prompts, not 0"),
        (["a"] * 33, "a list must hold 1-32 prompts, not 33"),
        (["ok", "  "], "prompt 1 is empty"),
        (["x" * 4001], "prompt 0 is over 4000 characters"),
        ([7], "prompt 0 must be a string or a non-empty list of chat messages"),
        ([[]], "prompt 0 must be a string or a non-empty list of chat messages"),
        ([[{"role": "assistant", "content": "a"}]], "prompt 0 must end with a user message"),
        (
            [[{"role": "tool", "content": "a"}]],
            "prompt 0, message 0: role must be one of system, user, assistant",
        ),
        ([[{"role": "user", "content": ""}]], "prompt 0, message 0: content must be a non-empty string"),
        (
            [[{"role": "user", "content": "a", "name": "x"}]],
            "prompt 0, message 0 must be an object with role",
        ),
        ([[USER] * 17], "prompt 0 has over 16 messages"),
    ],
)
def test_bad_sample_prompts_are_one_clear_error_on_the_field(value: Any, message: str) -> None:
    loc, msg = error(sample_prompts=value)
    assert loc == ("sample_prompts",) and message in msg


def test_bounds_and_dependencies_of_the_other_fields() -> None:
    assert error(sample_max_tokens=0)[0] == ("sample_max_tokens",)
    assert error(sample_max_tokens=513)[0] == ("sample_max_tokens",)
    assert "sample_at_eval needs sample_prompts" in error(sample_at_eval=True)[1]
    assert "needs validation_fraction" in error(sample_at_eval=True, sample_prompts=2)[1]
    JobSpec(**BASE, sample_at_eval=True, sample_prompts=2, validation_fraction=0.1)


def samples(step: int, at: str, text: str) -> SamplesRecord:
    return SamplesRecord(step=step, at=at, items=[SampleItem(prompt="p", base="b", tuned=text)])


def test_a_resume_keeps_one_set_per_point_in_order(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    records = [
        StartRecord(total_steps=6, num_examples=8),
        samples(2, "eval", "first at 2"),
        samples(4, "eval", "lost at 4"),  # the run dies at step 5, after its checkpoint at step 2
        StartRecord(total_steps=6, num_examples=8, resumed_from_step=2),
        samples(4, "eval", "again at 4"),
        samples(6, "end", "end"),  # dies before its done record
        StartRecord(total_steps=6, num_examples=8, resumed_from_step=6),
        samples(6, "end", "end again"),
    ]
    path.write_text("".join(encode(r) + "\n" for r in records))
    kept = latest_samples(read_records(path))
    assert [(r.step, r.at, r.items[0].tuned) for r in kept] == [
        (2, "eval", "first at 2"),
        (4, "eval", "again at 4"),
        (6, "end", "end again"),
    ]
