"""Planner: suggestions that make a job fit, and the plan's speed with them."""

from __future__ import annotations

import time

from core.arch import from_config
from core.spec import JobSpec
from planner import estimate
from planner.gpus import resolve_gpu
from tests.planner.planner_util import LLAMA2_7B, LLAMA3_8B, spec


def test_suggestions_fit_and_cheapest_come_first() -> None:
    arch, gpu = from_config(LLAMA2_7B), resolve_gpu("24GB")
    job = spec(method="lora", micro_batch_size=8, max_seq_len=2048, gradient_checkpointing=False)
    plan = estimate(job, arch, gpu)
    assert not plan.fits and plan.suggestions
    for s in plan.suggestions:
        again = estimate(job.model_copy(update=s.change), arch, gpu, suggest=False)
        assert s.fits and again.fits and again.total_bytes == s.plan_total_bytes <= gpu.usable_bytes
        assert set(s.change) <= set(JobSpec.model_fields)
    first = plan.suggestions[0].change
    assert first.get("gradient_checkpointing") is True  # the cheapest lever comes first
    if "micro_batch_size" in first:
        assert first["micro_batch_size"] * first["gradient_accumulation_steps"] == 8


def test_no_suggestions_when_it_fits_and_combinations_when_needed() -> None:
    arch = from_config(LLAMA2_7B)
    assert estimate(spec(method="qlora"), arch, resolve_gpu("A100-80GB")).suggestions == []
    job = spec(method="full", micro_batch_size=8, max_seq_len=2048)
    plan = estimate(job, from_config(LLAMA3_8B), resolve_gpu("24GB"))
    assert plan.suggestions and all(s.fits for s in plan.suggestions)
    assert all(" + " in s.description for s in plan.suggestions)  # no single lever is enough here


def test_plan_with_suggestions_is_fast() -> None:
    arch, gpu = from_config(LLAMA3_8B), resolve_gpu("T4")
    job = spec(method="full", micro_batch_size=16, max_seq_len=8192)
    best = min(_timed(lambda: estimate(job, arch, gpu, tokens_per_epoch=10**7)) for _ in range(3))
    assert best < 0.25  # the requirement is 50 ms; the bench prints the real figure


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
