"""Aggregate queries for the dashboard and /metrics: counts by status, finished durations, throughput."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core.states import TERMINAL, JobStatus
from models.tables import Job, Tenant


def counts_by_status(session: Session, tenant_id: str | None = None) -> dict[str, int]:
    """Every status, zeros included, so a dashboard or a Prometheus series never disappears."""
    stmt = select(Job.status, func.count()).group_by(Job.status)
    if tenant_id is not None:
        stmt = stmt.where(Job.tenant_id == tenant_id)
    counts = {str(s): 0 for s in JobStatus}
    for status, n in session.execute(stmt).all():
        counts[status] = int(n)
    return counts


def finished_durations(session: Session) -> list[tuple[str, float]]:
    """(status, seconds from start to finish) of every terminal job that ran."""
    rows = session.execute(
        select(Job.status, Job.started_at, Job.finished_at).where(
            Job.status.in_([str(s) for s in TERMINAL]),
            Job.started_at.is_not(None),
            Job.finished_at.is_not(None),
        )
    ).all()
    return [(status, max(0.0, (end - start).total_seconds())) for status, start, end in rows]


def running_throughput(session: Session) -> list[tuple[str, str, float]]:
    """(job id, worker id, tokens/s) of running jobs that have reported a step."""
    rows = session.execute(
        select(Job.id, Job.worker_id, Job.tokens_per_s).where(
            Job.status == JobStatus.RUNNING, Job.tokens_per_s.is_not(None)
        )
    ).all()
    return [(job_id, worker or "", float(tps)) for job_id, worker, tps in rows]


def tenant_names(session: Session) -> dict[str, str]:
    return {t.id: t.name for t in session.scalars(select(Tenant)).all()}
