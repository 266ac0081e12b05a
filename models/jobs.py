"""Queries on jobs. Every state change is a compare-and-set, so concurrent or stale writers cannot win."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from core.data.token_stats import PENDING, TokenStats, needs_attention, summary
from core.spec import ID_RE, JobSpec
from core.states import TERMINAL, JobStatus
from models.pagination import newest_first, page
from models.tables import Artifact, Job, JobEvent, utcnow


def add_event(
    session: Session, job_id: str, kind: str, message: str, data: dict[str, Any] | None = None
) -> JobEvent:
    ev = JobEvent(job_id=job_id, kind=kind, message=message, data=data)
    session.add(ev)
    return ev


def create_job(
    session: Session,
    tenant_id: str,
    job_id: str,
    spec: JobSpec,
    predicted_peak_bytes: int | None = None,
    max_attempts: int = 3,
) -> Job:
    job = Job(
        id=job_id,
        tenant_id=tenant_id,
        status=JobStatus.QUEUED,
        spec=spec.model_dump(mode="json"),
        dataset_id=spec.dataset_id,
        base_model=spec.base_model,
        method=spec.method,
        attempt=0,
        max_attempts=max_attempts,
        cancel_requested=False,
        step=0,
        predicted_peak_bytes=predicted_peak_bytes,
        token_stats=PENDING,  # computed in the background (api.token_stats) or at training start
    )
    session.add(job)
    session.flush()
    add_event(session, job_id, "queued", "job accepted and queued")
    return job


def get_job(session: Session, job_id: str, tenant_id: str | None = None) -> Job | None:
    """The job, if it exists and (when tenant_id is given) belongs to that tenant."""
    if not ID_RE.match(job_id):  # e.g. "../x" or a NUL byte, which PostgreSQL refuses with an error
        return None
    job = session.get(Job, job_id)
    return job if job is not None and tenant_id in (None, job.tenant_id) else None


def list_jobs(
    session: Session, limit: int, after: str | None, status: str | None = None, tenant_id: str | None = None
) -> tuple[list[Job], str | None]:
    stmt = select(Job) if tenant_id is None else select(Job).where(Job.tenant_id == tenant_id)
    if status:
        stmt = stmt.where(Job.status == status)
    rows = session.scalars(newest_first(stmt, Job, after, limit)).all()
    return page(list(rows), limit)


def list_events(session: Session, job_id: str, after: int, limit: int) -> tuple[list[JobEvent], bool]:
    rows = session.scalars(
        select(JobEvent)
        .where(JobEvent.job_id == job_id, JobEvent.id > after)
        .order_by(JobEvent.id)
        .limit(limit + 1)
    ).all()
    return list(rows[:limit]), len(rows) > limit


def store_token_stats(session: Session, job_id: str, stats: dict[str, Any]) -> bool:
    """Store statistics computed at job creation, unless training's start has filled them already
    (compare-and-set on "pending"). False if they were not stored."""
    return _set_token_stats(session, job_id, stats, _token_stats_status() == "pending")


def fill_token_stats(session: Session, job_id: str, stats: dict[str, Any]) -> bool:
    """Store statistics from training's start record unless ready ones are there: covers an API
    process that died (pending), a computation that failed, and jobs older than the column (NULL)."""
    return _set_token_stats(session, job_id, stats, _token_stats_status() != "ready")


def _token_stats_status() -> Any:
    # NULL (column or key missing) compares as "": a NULL would make != "ready" unknown, not true.
    return func.coalesce(Job.token_stats["status"].as_string(), "")


def _set_token_stats(session: Session, job_id: str, stats: dict[str, Any], condition: Any) -> bool:
    value = TokenStats.model_validate(stats)
    stored = value.model_dump(mode="json", exclude_none=True)
    result = session.execute(update(Job).where(Job.id == job_id, condition).values(token_stats=stored))
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return False
    if value.status == "ready":
        level = "warning" if needs_attention(value) else "info"
        add_event(session, job_id, "token_stats", summary(value), {**stored, "level": level})
    elif value.error is not None:
        msg = f"token statistics failed ({value.error.code}): {value.error.message}"
        add_event(session, job_id, "token_stats", msg, {**stored, "level": "warning"})
    return True


def mark_enqueued(session: Session, job_id: str) -> None:
    session.execute(update(Job).where(Job.id == job_id).values(enqueued_at=utcnow()))


def claim(session: Session, job_id: str, worker_id: str, lease_seconds: float) -> int | None:
    """queued -> running for this worker. Returns the new attempt number, or None if not claimable."""
    now = utcnow()
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.QUEUED, Job.cancel_requested.is_(False))
        .values(
            status=JobStatus.RUNNING,
            attempt=Job.attempt + 1,
            worker_id=worker_id,
            lease_until=now + timedelta(seconds=lease_seconds),
            started_at=now,
            updated_at=now,
        )
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return None
    attempt = session.scalar(select(Job.attempt).where(Job.id == job_id))
    add_event(session, job_id, "started", f"attempt {attempt} started on {worker_id}", {"attempt": attempt})
    return attempt


def _running(job_id: str, attempt: int) -> Any:
    return (Job.id == job_id, Job.attempt == attempt, Job.status == JobStatus.RUNNING)


def heartbeat(session: Session, job_id: str, attempt: int, lease_seconds: float, **progress: Any) -> bool:
    """Extend the lease and record progress. False means this worker no longer owns the job."""
    now = utcnow()
    result = session.execute(
        update(Job)
        .where(*_running(job_id, attempt))
        .values(lease_until=now + timedelta(seconds=lease_seconds), updated_at=now, **progress)
    )
    return result.rowcount == 1  # type: ignore[attr-defined]


def cancel_requested(session: Session, job_id: str) -> bool:
    return bool(session.scalar(select(Job.cancel_requested).where(Job.id == job_id)))


def finish(
    session: Session,
    job_id: str,
    attempt: int,
    status: JobStatus,
    message: str,
    error: tuple[str, str] | None = None,
) -> bool:
    """running -> a terminal state (or back to queued for a retry), only for the owning attempt."""
    now = utcnow()
    values: dict[str, Any] = {"status": status, "updated_at": now, "lease_until": None}
    if status in TERMINAL:
        values["finished_at"] = now
        values["eta_seconds"] = None
    if error:
        values["error_code"], values["error_message"] = error
    result = session.execute(update(Job).where(*_running(job_id, attempt)).values(**values))
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return False
    data = {"attempt": attempt, **({"code": error[0]} if error else {})}
    add_event(session, job_id, str(status), message, data)
    return True


def request_cancel(session: Session, job: Job) -> str:
    """Cancel a queued job at once; ask a running one to stop. Returns what happened."""
    now = utcnow()
    result = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.status == JobStatus.QUEUED)
        .values(status=JobStatus.CANCELLED, cancel_requested=True, finished_at=now, updated_at=now)
    )
    if result.rowcount == 1:  # type: ignore[attr-defined]
        add_event(session, job.id, "cancelled", "cancelled before it started")
        return "cancelled"
    result = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.status == JobStatus.RUNNING)
        .values(cancel_requested=True, updated_at=now)
    )
    if result.rowcount == 1:  # type: ignore[attr-defined]
        add_event(session, job.id, "cancel_requested", "cancel requested; stopping after this step")
        return "cancelling"
    return "finished"


def expired_leases(session: Session, now: datetime) -> list[Job]:
    return list(
        session.scalars(select(Job).where(Job.status == JobStatus.RUNNING, Job.lease_until < now)).all()
    )


def stale_queued(session: Session, older_than: datetime) -> list[Job]:
    return list(
        session.scalars(
            select(Job).where(
                Job.status == JobStatus.QUEUED,
                (Job.enqueued_at.is_(None)) | (Job.enqueued_at < older_than),
            )
        ).all()
    )


def add_artifact(
    session: Session,
    artifact_id: str,
    job_id: str,
    kind: str,
    relpath: str,
    size_bytes: int,
    sha256: str,
    step: int | None,
) -> Artifact:
    art = Artifact(
        id=artifact_id,
        job_id=job_id,
        kind=kind,
        relpath=relpath,
        size_bytes=size_bytes,
        sha256=sha256,
        step=step,
    )
    session.add(art)
    return art


def find_artifact(session: Session, job_id: str, kind: str) -> Artifact | None:
    return session.scalar(
        select(Artifact)
        .where(Artifact.job_id == job_id, Artifact.kind == kind)
        .order_by(Artifact.created_at.desc())
        .limit(1)
    )
