"""models.auto_batch.split_batch: an effective batch split into the largest micro-batch whose plan fits (the
planner replaced by a small double that fits a spec by its micro-batch and its rollouts' prompts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from core.spec import JobSpec
from models import auto_batch
from tests.planner.test_planner_grpo import GRADER


@dataclass
class Plan:
    fits: bool


def split(monkeypatch: pytest.MonkeyPatch, spec: JobSpec, fits: Any, per_gpu: int = 8) -> JobSpec:
    tried: list[JobSpec] = []

    def make_plan(session: Any, *, spec: JobSpec, **_: Any) -> Plan | None:
        tried.append(spec)
        return None if fits is None else Plan(fits(spec))

    monkeypatch.setattr(auto_batch, "make_plan", make_plan)
    no_db: Any = None
    got = auto_batch.split_batch(no_db, catalog=no_db, spec=spec, per_gpu=per_gpu, tenant_id="t", plan_gpu="")
    assert got.micro_batch_size * got.gradient_accumulation_steps == per_gpu
    assert fits is None or got in tried  # a split that was planned
    return got


def test_the_largest_micro_batch_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    sft = JobSpec(base_model="m", dataset_id="dataset0001")
    got = split(monkeypatch, sft, lambda s: s.micro_batch_size <= 2)
    assert (got.micro_batch_size, got.gradient_accumulation_steps) == (2, 4)
    # no split fits: the smallest, which admission then refuses with the planner's reasons
    assert split(monkeypatch, sft, lambda s: False).micro_batch_size == 1
    assert split(monkeypatch, sft, None).micro_batch_size == 4  # nothing to plan on: JobSpec's default


def test_a_batch_of_examples_keeps_its_examples_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """/v1's batch_size: examples_per_step stays what was asked whatever the split."""
    spec = JobSpec(base_model="m", dataset_id="dataset0001", examples_per_step=8)
    got = split(monkeypatch, spec, lambda s: s.micro_batch_size <= 2)
    assert (got.examples_per_step, got.micro_batch_size, got.gradient_accumulation_steps) == (8, 2, 4)


def test_grpo_samples_a_micro_batchs_prompts_at_a_time_only_where_a_whole_step_cannot_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grpo = JobSpec(base_model="m", dataset_id="dataset0001", objective="grpo", grader=GRADER)
    roomy = split(monkeypatch, grpo, lambda s: s.micro_batch_size <= 2)
    assert (roomy.micro_batch_size, roomy.rollout_batch_size, roomy.rl.rollout_prompts) == (2, None, 8)
    tight = split(monkeypatch, grpo, lambda s: s.micro_batch_size <= 2 and s.rl.rollout_prompts <= 4)
    assert (tight.micro_batch_size, tight.rollout_batch_size) == (2, 2)
    asked = grpo.model_copy(update={"rollout_batch_size": 8})  # the caller's own setting is kept
    assert split(monkeypatch, asked, lambda s: s.rl.rollout_prompts <= 4).rollout_batch_size == 8
