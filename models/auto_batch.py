"""Splitting an effective batch into micro-batch x accumulation: the planner's largest micro-batch that fits.

Used by /v1/fine_tuning/jobs for `batch_size` (a number or "auto"), whose spec counts it in examples
(examples_per_step, kept): with packing a step's examples fill at most as many rows, so a step runs at most
accumulation micro-batches per GPU, fewer where they pack tighter. The micro-batch is the largest divisor
of the per-GPU batch whose plan fits where the job would run (the fleet, else settings.plan_gpu); the rest
is gradient accumulation, so the effective batch is the one asked for. With nothing to plan on (no worker
registered, no plan_gpu), the largest divisor up to JobSpec's default micro-batch. Objective grpo samples
all of a step's prompts at once (rollout_batch_size unset): where no split fits so, the splits are tried
again sampling a micro-batch's prompts at a time. When no split fits, the smallest (micro-batch 1), which
admission then refuses with the planner's breakdown and suggestions.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from core.catalog import Catalog
from core.spec import JobSpec, limits
from models.admission import make_plan

DEFAULT_MICRO: int = JobSpec.model_fields["micro_batch_size"].default
MAX_MICRO: int = limits("micro_batch_size")["le"]
MAX_ACCUM: int = limits("gradient_accumulation_steps")["le"]


def split_batch(
    session: Session, *, catalog: Catalog, spec: JobSpec, per_gpu: int, tenant_id: str, plan_gpu: str
) -> JobSpec:
    """`spec` with micro_batch_size x gradient_accumulation_steps = per_gpu, the largest micro that fits."""
    divisors = [
        d for d in range(min(per_gpu, MAX_MICRO), 0, -1) if per_gpu % d == 0 and per_gpu // d <= MAX_ACCUM
    ]

    def with_micro(micro: int, sample_per_micro: bool = False) -> JobSpec:
        update: dict[str, int] = {"micro_batch_size": micro, "gradient_accumulation_steps": per_gpu // micro}
        if sample_per_micro:
            update["rollout_batch_size"] = micro
        return JobSpec.model_validate(spec.model_dump() | update)

    # grpo sampling a whole step's prompts at once first; then, where none fits so, a micro-batch's
    per_micro = [False, True] if spec.rl.enabled and spec.rollout_batch_size is None else [False]
    for sample_per_micro in per_micro:
        for micro in divisors:
            candidate = with_micro(micro, sample_per_micro)
            plan = make_plan(
                session, catalog=catalog, spec=candidate, gpu=None, tenant_id=tenant_id, plan_gpu=plan_gpu
            )
            if plan is None:  # nothing to plan on: stay near the default
                return with_micro(max(d for d in divisors if d <= DEFAULT_MICRO))
            if plan.fits:
                return candidate
    return with_micro(divisors[-1])
