"""the per-GPU breakdown and verdict (with suggestions when it does not fit)."""

from __future__ import annotations

from core.arch import Architecture
from core.spec import JobSpec
from planner.gpus import Gpu
from planner.peak import peak_plan
from planner.suggest import suggestions
from planner.types import FTUNE, BatchShape, Plan, Runtime


def estimate(
    spec: JobSpec,
    arch: Architecture,
    gpu: Gpu,
    tokens_per_epoch: int | None = None,
    *,
    suggest: bool = True,
    runtime: Runtime = FTUNE,
    shape: BatchShape | None = None,
) -> Plan:
    """`shape`: the data's largest micro-batch when its token statistics are known; without it every
    micro-batch is planned at micro_batch_size x max_seq_len tokens. Suggestions are planned for that
    worst case (a changed micro-batch or max_seq_len changes the data's micro-batches)."""
    plan = peak_plan(spec, arch, gpu, tokens_per_epoch, runtime, shape)
    if suggest and not plan.fits:
        plan = plan.model_copy(update={"suggestions": suggestions(spec, arch, gpu, runtime)})
    return plan
