"""Re-planning a queued job from its data, once its token statistics are ready.

A job is admitted before its data is tokenized, so its admission plan is the worst case: every
micro-batch micro_batch_size x max_seq_len tokens, every position scored. The token statistics give
the data's largest micro-batch (planner.BatchShape); the job is then planned again from it, as
admission plans (on the fleet, or FTUNE_PLAN_GPU). admission-plan.json keeps the admission plan;
plan.json, the job's predicted peak and a `replanned` event carry the new one. Placement plans from the
same shape on the worker that claims the job (models.placement), and that plan is the one it runs under.
Called by models.token_stats once it has stored a job's statistics.
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from core.catalog import Catalog
from core.errors import FtuneError
from core.spec import JobSpec
from core.states import JobStatus
from core.storage import Storage, atomic_write_text
from models import jobs as jobs_db
from models.admission import make_plan
from models.transitions import add_event
from planner import BatchShape, Plan

log = logging.getLogger(__name__)
GiB = 2**30
REPLANNED = "replanned"


def replan(
    session: Session, *, catalog: Catalog, storage: Storage, job_id: str, plan_gpu: str = ""
) -> Plan | None:
    """The job's plan from its data's lengths, recorded; None when there is nothing to re-plan (not
    queued, statistics not ready, or no device to plan on)."""
    job = jobs_db.get_job(session, job_id)
    if job is None or job.status != JobStatus.QUEUED:
        return None
    shape = BatchShape.from_token_stats(job.token_stats)
    if shape is None:
        return None
    spec = JobSpec.model_validate(job.spec)
    try:
        plan = make_plan(
            session,
            catalog=catalog,
            spec=spec,
            gpu=None,
            tenant_id=job.tenant_id,
            plan_gpu=plan_gpu,
            shape=shape,
        )
    except FtuneError as e:  # e.g. the base model was removed: placement fails it with a clear error
        log.warning("job %s: not re-planned: %s", job_id, e.message)
        return None
    if plan is None:
        return None
    admitted = job.predicted_peak_bytes
    atomic_write_text(storage.plan_path(job_id), plan.model_dump_json())
    jobs_db.set_predicted_peak(session, job_id=job_id, predicted_peak_bytes=plan.allocated_bytes)
    before = f" (admitted on the worst case: {admitted / GiB:.2f} GiB allocated)" if admitted else ""
    add_event(
        session,
        job_id=job_id,
        kind=REPLANNED,
        message=(
            f"re-planned from {shape.describe()}: {plan.allocated_bytes / GiB:.2f} GiB allocated, "
            f"{plan.total_bytes / GiB:.2f} GiB per device on {plan.gpu}{before}"
        ),
        data={
            "admission_predicted_bytes": admitted,
            "predicted_bytes": plan.allocated_bytes,
            "plan_total": plan.total_bytes,
            "device": plan.gpu,
            "batch_shape": shape.model_dump(),
        },
    )
    return plan
