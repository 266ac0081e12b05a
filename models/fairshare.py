"""Fair turns between tenants: which queued job a free worker claims next.

The policy, applied at claim time over the queued jobs the claiming worker can run:
- between tenants, the tenant with the fewest running jobs goes first; on a tie, the tenant served least
  recently (its latest start is the oldest, or it has none). So a tenant with one queued job starts in
  the next free slot even behind another tenant's fifty;
- within a tenant, higher `priority` first, then first in first out;
- a tenant already at max_running_jobs_per_tenant (0: no limit) is skipped, and the claim itself is
  guarded by that count, so two workers claiming at once cannot both exceed it (on SQLite, whose writes
  are serialised; on PostgreSQL two concurrent claims may each see the other uncommitted: one over, briefly).

This is the k-th-turn order: a tenant's k-th queued job (0-based) comes at turn running + k, so the same
ranking gives a queued job's position (models.queue_view).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session, aliased

from core.states import OWNED, JobStatus
from models import jobs as jobs_db
from models.tables import Job


def queued_jobs(session: Session) -> list[Job]:
    stmt = select(Job).where(Job.status == JobStatus.QUEUED, Job.cancel_requested.is_(False))
    return list(session.scalars(stmt.order_by(Job.created_at, Job.id)).all())


def running_per_tenant(session: Session) -> dict[str, int]:
    rows = session.execute(
        select(Job.tenant_id, func.count()).where(Job.status.in_(OWNED)).group_by(Job.tenant_id)
    ).all()
    return {t: int(n) for t, n in rows}


def last_start_per_tenant(session: Session) -> dict[str, datetime]:
    rows = session.execute(
        select(Job.tenant_id, func.max(Job.started_at))
        .where(Job.started_at.is_not(None))
        .group_by(Job.tenant_id)
    ).all()
    return {t: at for t, at in rows if at is not None}


def priority(job: Job) -> int:
    return int((job.spec or {}).get("priority") or 0)


def rank(
    jobs: list[Job], running: dict[str, int], last_start: dict[str, datetime]
) -> list[tuple[tuple[Any, ...], Job]]:
    """`jobs` in the order the policy serves them, each with its sort key (turn first)."""
    by_tenant: dict[str, list[Job]] = defaultdict(list)
    for job in jobs:
        by_tenant[job.tenant_id].append(job)
    keyed = []
    for tenant, own in by_tenant.items():
        own.sort(key=lambda j: (-priority(j), j.created_at, j.id))
        served = last_start.get(tenant)
        for k, job in enumerate(own):
            # never served sorts first on a tie; then the one served longest ago
            key = (running.get(tenant, 0) + k, served is not None, served or job.created_at, k)
            keyed.append((key, job))
    keyed.sort(key=lambda kj: (kj[0], kj[1].created_at, kj[1].id))
    return keyed


def under_limit(tenant_id: str, limit: int) -> tuple[ColumnElement[bool], ...]:
    """A claim guard: the tenant has fewer than `limit` running jobs (none when limit is 0)."""
    if limit <= 0:
        return ()
    other = aliased(Job)
    running = (
        select(func.count())
        .select_from(other)
        .where(other.tenant_id == tenant_id, other.status.in_(OWNED))
        .scalar_subquery()
    )
    return (running < limit,)


def claim_next(
    session: Session,
    *,
    can_run: Callable[[Job], bool],
    worker_id: str,
    lease_seconds: float,
    running_limit: int = 0,
) -> tuple[Job, int] | None:
    """Claim the next job this worker can run by the policy (compare-and-set; a job another worker took
    meanwhile is passed over). Returns the job and its new attempt number, or None."""
    candidates = [j for j in queued_jobs(session) if can_run(j)]
    if not candidates:
        return None
    running = running_per_tenant(session)
    for _, job in rank(candidates, running, last_start_per_tenant(session)):
        if running_limit and running.get(job.tenant_id, 0) >= running_limit:
            continue
        attempt = jobs_db.claim(
            session,
            job_id=job.id,
            worker_id=worker_id,
            lease_seconds=lease_seconds,
            guards=under_limit(job.tenant_id, running_limit),
        )
        if attempt is not None:
            return job, attempt
    return None
