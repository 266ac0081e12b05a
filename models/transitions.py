"""The one way a job's status changes: a compare-and-set transition of core.states' machine.

A transition the machine does not have raises (a bug); an allowed one that finds the row no longer in
`src` (or fenced off by `attempt` or another guard) changes nothing and returns False, so concurrent or
stale writers cannot win.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, update
from sqlalchemy.orm import Session

from core.states import OWNED, TERMINAL, JobStatus, check_transition
from models import webhooks
from models.db import rows_changed
from models.tables import Job, JobEvent, utcnow


def add_event(
    session: Session, *, job_id: str, kind: str, message: str, data: dict[str, Any] | None = None
) -> JobEvent:
    ev = JobEvent(job_id=job_id, kind=kind, message=message, data=data)
    session.add(ev)
    return ev


def transition(
    session: Session,
    *,
    job_id: str,
    src: JobStatus,
    dst: JobStatus,
    attempt: int | None = None,
    guards: tuple[ColumnElement[bool], ...] = (),
    values: dict[str, Any] | None = None,
    event: tuple[str, str, dict[str, Any] | None] | None = None,
) -> bool:
    """Move the job from `src` to `dst` if it is still in `src` (and, when given, still on `attempt` and
    matching `guards`), setting `values` too; then record `event` (kind, message, data). False if it lost."""
    check_transition(src, dst)
    now = utcnow()
    row: dict[str, Any] = {"status": dst, "updated_at": now}
    if dst in TERMINAL:
        row |= {"finished_at": now, "eta_seconds": None}
    if dst not in OWNED:
        row["lease_until"] = None  # only an owned job has a lease for the reaper to watch
    row |= values or {}
    stmt = update(Job).where(Job.id == job_id, Job.status == src, *guards)
    if attempt is not None:
        stmt = stmt.where(Job.attempt == attempt)
    result = session.execute(stmt.values(**row))
    if rows_changed(result) != 1:
        return False
    if event is not None:
        kind, message, data = event
        add_event(session, job_id=job_id, kind=kind, message=message, data=data)
    if dst in TERMINAL:  # the webhook outbox, in this same transaction: the event exists iff the job ended
        webhooks.add_job_event(session, job_id=job_id, status=dst)
    return True
