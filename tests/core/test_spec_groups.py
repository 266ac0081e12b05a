"""JobSpec's groups (core.spec_groups): views of the flat fields, their derived values, and their checks
reported as before (the first problem across groups, at the spec's loc)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import ValidationError

from core.spec import DPO_FIELDS, JobSpec, group_defaults
from core.spec_groups import PREFERENCE

BASE = {"base_model": "tiny", "dataset_id": "abcdefgh12"}

# view -> {view field: flat field}, for the fields a view renames or borrows
RENAMED = {
    "lora": {
        "r": "lora_r",
        "alpha": "lora_alpha",
        "dropout": "lora_dropout",
        "target_modules": "lora_target_modules",
    },
    "samples": {"prompts": "sample_prompts", "max_tokens": "sample_max_tokens", "at_eval": "sample_at_eval"},
}


def spec(**fields: Any) -> JobSpec:
    return JobSpec(**BASE, **fields)


def first_error(**fields: Any) -> tuple[tuple[Any, ...], str]:
    with pytest.raises(ValidationError) as e:
        spec(**fields)
    (err,) = e.value.errors()
    return err["loc"], err["msg"].removeprefix("Value error, ")


@pytest.mark.parametrize("name", ["lora", "optim", "data", "batch", "preference", "samples", "placement"])
def test_each_view_holds_the_flat_values(name: str) -> None:
    s = spec(
        method="qlora",
        lora_r=8,
        lora_target_modules=["q_proj"],
        learning_rate=1e-3,
        warmup_ratio=0.1,
        validation_fraction=0.1,
        micro_batch_size=2,
        num_gpus=2,
        objective="dpo",
        loss_type="simpo",
        sample_prompts=["Hi?"],
        sample_at_eval=True,
    )
    view = getattr(s, name)
    for f in dataclasses.fields(view):
        flat = RENAMED.get(name, {}).get(f.name, f.name)
        if flat == "sequences_per_example":
            continue
        assert getattr(view, f.name) == getattr(s, flat), (name, f.name)


def test_derived_values() -> None:
    s = spec(micro_batch_size=2, gradient_accumulation_steps=3, num_gpus=4, max_seq_len=64, objective="dpo")
    assert (s.batch.effective_size, s.effective_batch_size) == (24, 24)
    assert (s.batch.micro_sequences, s.batch.row_capacity, s.batch.worst_case_tokens) == (4, 128, 256)
    assert s.preference.enabled and s.preference.uses_reference and s.uses_reference
    assert not spec(objective="dpo", loss_type="simpo").preference.uses_reference
    assert spec().batch.worst_case_tokens == 4 * 512
    assert spec(warmup_ratio=0.3).optim.warmup_steps_for(10) == 3 == spec(warmup_steps=3).warmup_steps_for(10)
    assert (spec().optim.clip_norm, spec(max_grad_norm=None).optim.clip_norm) == (1.0, float("inf"))
    assert spec(validation_dataset_id="abcdefgh13").data.has_validation and not spec().has_validation
    assert spec(lora_r=8, lora_alpha=16).lora.scaling == 2.0
    assert (
        spec(method="qlora").placement.gradient_checkpointing and not spec().placement.gradient_checkpointing
    )
    assert spec(num_gpus=2).placement.sharded and not spec().placement.sharded
    assert (
        spec(sample_prompts=["Hi?"]).samples.given == ["Hi?"] and spec(sample_prompts=3).samples.given is None
    )


def test_preference_defaults_are_the_specs() -> None:
    defaults = {f: JobSpec.model_fields[f].default for f in ("objective", *DPO_FIELDS)}
    assert defaults == dict(group_defaults(PREFERENCE)) == dataclasses.asdict(spec().preference)
    assert DPO_FIELDS == ("beta", "loss_type", "simpo_gamma", "rpo_alpha")


def test_the_first_problem_across_groups_is_reported() -> None:
    """The groups are checked in one order (lora, samples, preference, data), as the validators ran."""
    everything = {"init_from_step": 2, "sample_at_eval": True, "beta": 0.3, "early_stopping_patience": 1}
    assert first_error(**everything) == (
        (),
        "init_from_step needs init_from (the job whose checkpoint to continue from)",
    )
    del everything["init_from_step"]
    assert first_error(**everything) == ((), "sample_at_eval needs sample_prompts")
    del everything["sample_at_eval"]
    assert first_error(**everything) == ((), "beta apply to objectives 'dpo' and 'grpo' only")
    del everything["beta"]
    assert first_error(**everything) == (
        (),
        "early_stopping_patience needs validation_fraction or validation_dataset_id",
    )
    assert first_error(lora_target_modules=[]) == (
        ("lora_target_modules",),
        "must name at least one module, or be 'all-linear'",
    )
