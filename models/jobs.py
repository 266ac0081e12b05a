"""Queries on jobs. Every state change is a compare-and-set, so concurrent or stale writers cannot win."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, func, select, update
from sqlalchemy.orm import Session

from core.data.token_stats import PENDING, TokenStats, needs_attention, summary
from core.spec import ID_RE, JobSpec
from core.states import OWNED, TERMINAL, JobStatus
from models.db import rows_changed
from models.pagination import newest_first, page
from models.tables import Artifact, Job, JobEvent, utcnow
from models.transitions import add_event, transition

__all__ = ["add_event", "transition"]  # re-exported: callers write jobs_db.add_event(...)


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
        token_stats=PENDING,  # measured by a CPU worker or at training start (models.token_stats)
    )
    session.add(job)
    session.flush()
    add_event(session, job_id=job_id, kind="queued", message="job accepted and queued")
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


def stream_marks(session: Session, job_ids: list[str]) -> dict[str, tuple[str, int | None]]:
    """Each job's status and last event id (None: no events; a job not there is left out), for every job
    of `job_ids` in one query: what the API's event streams watch for a change (api/watch.py)."""
    last = (
        select(JobEvent.job_id, func.max(JobEvent.id).label("last_id"))
        .where(JobEvent.job_id.in_(job_ids))
        .group_by(JobEvent.job_id)
        .subquery()
    )
    stmt = (
        select(Job.id, Job.status, last.c.last_id)
        .outerjoin(last, last.c.job_id == Job.id)
        .where(Job.id.in_(job_ids))
    )
    return {job_id: (status, last_id) for job_id, status, last_id in session.execute(stmt)}


def store_token_stats(session: Session, job_id: str, stats: dict[str, Any]) -> bool:
    """Store statistics computed at job creation, unless training's start has filled them already
    (compare-and-set on "pending"). False if they were not stored."""
    return _set_token_stats(session, job_id, stats, _token_stats_status() == "pending")


def fill_token_stats(session: Session, job_id: str, stats: dict[str, Any]) -> bool:
    """Store statistics from training's start record unless ready ones are there: covers a computation
    that never ran (no CPU worker, a lost message: pending), one that failed, and jobs older than the
    column (NULL)."""
    return _set_token_stats(session, job_id, stats, _token_stats_status() != "ready")


def _token_stats_status() -> Any:
    # NULL (column or key missing) compares as "": a NULL would make != "ready" unknown, not true.
    return func.coalesce(Job.token_stats["status"].as_string(), "")


def _set_token_stats(session: Session, job_id: str, stats: dict[str, Any], condition: Any) -> bool:
    value = TokenStats.model_validate(stats)
    stored = value.model_dump(mode="json", exclude_none=True)
    result = session.execute(update(Job).where(Job.id == job_id, condition).values(token_stats=stored))
    if rows_changed(result) != 1:
        return False
    if value.status == "ready":
        level = "warning" if needs_attention(value) else "info"
        add_event(
            session,
            job_id=job_id,
            kind="token_stats",
            message=summary(value),
            data={**stored, "level": level},
        )
    elif value.error is not None:
        msg = f"token statistics failed ({value.error.code}): {value.error.message}"
        add_event(
            session, job_id=job_id, kind="token_stats", message=msg, data={**stored, "level": "warning"}
        )
    return True


def set_predicted_peak(session: Session, *, job_id: str, predicted_peak_bytes: int) -> None:
    """The plan re-made on the worker that claimed the job (placement) replaces the admission's."""
    session.execute(update(Job).where(Job.id == job_id).values(predicted_peak_bytes=predicted_peak_bytes))


def mark_enqueued(session: Session, *, job_id: str) -> None:
    session.execute(update(Job).where(Job.id == job_id).values(enqueued_at=utcnow()))


def claim(
    session: Session,
    *,
    job_id: str,
    worker_id: str,
    lease_seconds: float,
    guards: tuple[ColumnElement[bool], ...] = (),
) -> int | None:
    """queued -> running for this worker (and `guards`, e.g. the tenant's running limit). Returns the new
    attempt number, or None if not claimable."""
    now = utcnow()
    claimed = transition(
        session,
        job_id=job_id,
        src=JobStatus.QUEUED,
        dst=JobStatus.RUNNING,
        guards=(Job.cancel_requested.is_(False), *guards),
        values={
            "attempt": Job.attempt + 1,
            "worker_id": worker_id,
            "lease_until": now + timedelta(seconds=lease_seconds),
            "started_at": now,
        },
    )
    if not claimed:
        return None
    attempt = session.scalar(select(Job.attempt).where(Job.id == job_id))
    msg = f"attempt {attempt} started on {worker_id}"
    add_event(session, job_id=job_id, kind="started", message=msg, data={"attempt": attempt})
    return attempt


def heartbeat(session: Session, *, job_id: str, attempt: int, lease_seconds: float, **progress: Any) -> bool:
    """Extend the lease and record progress (no change of status). False means this attempt no longer
    owns the job."""
    now = utcnow()
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.attempt == attempt, Job.status.in_(OWNED))
        .values(lease_until=now + timedelta(seconds=lease_seconds), updated_at=now, **progress)
    )
    return rows_changed(result) == 1


def stop_wanted(session: Session, *, job_id: str) -> bool:
    """Whether the run should checkpoint and stop: a cancel or a pause was asked for."""
    row = session.execute(select(Job.status, Job.cancel_requested).where(Job.id == job_id)).one_or_none()
    return row is not None and (row.cancel_requested or row.status == JobStatus.PAUSING)


def cancel_requested(session: Session, *, job_id: str) -> bool:
    return bool(session.scalar(select(Job.cancel_requested).where(Job.id == job_id)))


def finish(
    session: Session,
    *,
    job_id: str,
    attempt: int,
    dst: JobStatus,
    message: str,
    error: tuple[str, str] | None = None,
    paused_message: str | None = None,
) -> JobStatus | None:
    """End the owning attempt: to `dst`, or to paused instead of queued (a retry or a worker's shutdown)
    when a pause was asked for meanwhile, with `paused_message`. Returns the status reached, None if the
    attempt lost the job."""
    values = {"error_code": error[0], "error_message": error[1]} if error else {}
    data = {"attempt": attempt, **({"code": error[0]} if error else {})}
    for _ in range(len(OWNED) + 1):  # the API may move running -> pausing between the read and the write
        src = session.scalar(select(Job.status).where(Job.id == job_id, Job.attempt == attempt))
        if src not in OWNED:
            return None
        to = JobStatus.PAUSED if dst == JobStatus.QUEUED and src == JobStatus.PAUSING else dst
        msg = message if to == dst else paused_message or f"{message}; paused as requested"
        if transition(
            session,
            job_id=job_id,
            src=JobStatus(src),
            dst=to,
            attempt=attempt,
            values=values,
            event=(str(to), msg, data),
        ):
            return to
    return None


def release_expired(session: Session, *, job: Job) -> JobStatus | None:
    """A job whose worker stopped renewing its lease: back in line to resume from its checkpoint (paused
    if a pause was asked for), or failed once it has had max_attempts. None if someone else moved it."""
    src = JobStatus(job.status)
    lost = f"worker {job.worker_id} lost during attempt {job.attempt}"
    values: dict[str, Any]
    event: tuple[str, str, dict[str, Any] | None]
    if job.attempt >= job.max_attempts:
        message = f"the worker was lost {job.attempt} times (max_attempts)"
        dst, values = JobStatus.FAILED, {"error_code": "worker_lost", "error_message": message}
        event = ("failed", message, {"code": "worker_lost", "attempt": job.attempt})
    elif src == JobStatus.PAUSING:
        dst, values = JobStatus.PAUSED, {}
        event = ("paused", f"{lost}; paused as requested, resumes from its last checkpoint", None)
    else:
        dst, values = JobStatus.QUEUED, {"enqueued_at": utcnow()}
        event = ("retried", f"{lost}; retrying from last checkpoint", {"attempt": job.attempt})
    moved = transition(
        session, job_id=job.id, src=src, dst=dst, attempt=job.attempt, values=values, event=event
    )
    return dst if moved else None


def request_cancel(session: Session, *, job_id: str) -> str:
    """Cancel a queued or paused job at once; ask a running (or pausing) one to stop. Returns what happened:
    "cancelled", "cancelling" or "finished" (too late)."""
    for src, how in ((JobStatus.QUEUED, "before it started"), (JobStatus.PAUSED, "while paused")):
        if transition(
            session,
            job_id=job_id,
            src=src,
            dst=JobStatus.CANCELLED,
            values={"cancel_requested": True},
            event=("cancelled", f"cancelled {how}", None),
        ):
            return "cancelled"
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(OWNED))
        .values(cancel_requested=True, updated_at=utcnow())
    )
    if rows_changed(result) == 1:
        msg = "cancel requested; stopping after this step"
        add_event(session, job_id=job_id, kind="cancel_requested", message=msg)
        return "cancelling"
    return "finished"


def request_pause(session: Session, *, job_id: str) -> bool:
    """Pause a queued job at once; ask a running one to checkpoint and stop. False if its state does not
    allow a pause (pausing or paused already, being cancelled, or finished)."""
    if transition(
        session,
        job_id=job_id,
        src=JobStatus.QUEUED,
        dst=JobStatus.PAUSED,
        guards=(Job.cancel_requested.is_(False),),
        event=("paused", "paused before it started", None),
    ):
        return True
    return transition(
        session,
        job_id=job_id,
        src=JobStatus.RUNNING,
        dst=JobStatus.PAUSING,
        guards=(Job.cancel_requested.is_(False),),
        event=("pause_requested", "pause requested; checkpointing after this step", None),
    )


def resume(session: Session, *, job_id: str) -> bool:
    """paused -> queued: it continues from its last checkpoint, as after a lost worker. The caller wakes
    a worker after the commit. False if the job is not paused."""
    step = session.scalar(select(Job.step).where(Job.id == job_id))
    return transition(
        session,
        job_id=job_id,
        src=JobStatus.PAUSED,
        dst=JobStatus.QUEUED,
        # A pause does not use up a retry: the attempt the resumed run will claim is granted here.
        values={"enqueued_at": utcnow(), "max_attempts": Job.max_attempts + 1},
        event=("resumed", f"resumed; continues from its last checkpoint (step {step})", {"step": step}),
    )


def expired_leases(session: Session, *, now: datetime) -> list[Job]:
    return list(session.scalars(select(Job).where(Job.status.in_(OWNED), Job.lease_until < now)).all())


def owned_by(session: Session, *, worker_id: str) -> list[Job]:
    return list(session.scalars(select(Job).where(Job.status.in_(OWNED), Job.worker_id == worker_id)).all())


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


def mark_deleted(session: Session, *, job_id: str) -> bool:
    """Mark a finished job deleted and drop its artifact rows (the caller removes the files after the
    commit); the job's row and events stay. False if it is not finished (nothing changed)."""
    finished = [status.value for status in TERMINAL]
    done = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(finished), Job.deleted_at.is_(None))
        .values(deleted_at=utcnow())
    )
    if not rows_changed(done):
        job = session.get(Job, job_id)
        return job is not None and job.deleted_at is not None  # deleted already: the same outcome
    for art in session.scalars(select(Artifact).where(Artifact.job_id == job_id)):
        session.delete(art)
    add_event(session, job_id=job_id, kind="deleted", message="job files deleted; the record is kept")
    return True
