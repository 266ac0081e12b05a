"""Cancel, pause and resume a job the caller may see: the transition, or a Conflict that names the state
it is in. One place for both surfaces (/jobs and /v1); each names its id parameter and reads the job back
in its own shape. The caller has checked the job exists and is theirs."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from core.errors import Conflict
from models import jobs as jobs_db
from models.db import session_scope


def cancel(sessions: sessionmaker[Session], *, job_id: str, param: str) -> None:
    """A queued or paused job is cancelled at once; a running one stops after its current step."""
    with session_scope(sessions) as s:
        if jobs_db.request_cancel(s, job_id=job_id) != "finished":
            return
        status = _status(s, job_id)
    raise Conflict(f"job {job_id} already {status}", code="job_finished", param=param)


def pause(sessions: sessionmaker[Session], *, job_id: str, param: str) -> None:
    """A queued job is paused at once; a running one saves a checkpoint after its current step."""
    with session_scope(sessions) as s:
        if jobs_db.request_pause(s, job_id=job_id):
            return
        job = jobs_db.get_job(s, job_id)
        status, cancelling = (job.status, job.cancel_requested) if job else ("gone", False)
    why = " (a cancel was requested)" if cancelling else ""
    raise Conflict(
        f"job {job_id} is {status}{why}; only a queued or running job can be paused",
        code="job_not_pausable",
        param=param,
        details={"status": status, "cancel_requested": cancelling},
    )


def resume(sessions: sessionmaker[Session], *, job_id: str, param: str) -> None:
    """A paused job goes back to the queue and continues from its checkpoint. The caller wakes a worker
    (core.queues) once it has read the job for its answer, so the answer says queued."""
    with session_scope(sessions) as s:
        if jobs_db.resume(s, job_id=job_id):
            return
        status = _status(s, job_id)
    raise Conflict(
        f"job {job_id} is {status}; only a paused job can be resumed",
        code="job_not_paused",
        param=param,
        details={"status": status},
    )


def _status(session: Session, job_id: str) -> str:
    job = jobs_db.get_job(session, job_id)
    return str(job.status) if job is not None else "gone"
