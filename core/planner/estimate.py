"""the per-GPU breakdown and verdict (with suggestions when it does not fit)."""

from __future__ import annotations

from core.arch import Architecture
from core.planner.gpus import Gpu
from core.planner.peak import peak_plan
from core.planner.suggest import suggestions
from core.planner.types import FTUNE, Plan, Runtime
from core.spec import JobSpec


def estimate(
    spec: JobSpec,
    arch: Architecture,
    gpu: Gpu,
    tokens_per_epoch: int | None = None,
    *,
    suggest: bool = True,
    runtime: Runtime = FTUNE,
) -> Plan:
    plan = peak_plan(spec, arch, gpu, tokens_per_epoch, runtime)
    if suggest and not plan.fits:
        plan = plan.model_copy(update={"suggestions": suggestions(spec, arch, gpu, runtime)})
    return plan
