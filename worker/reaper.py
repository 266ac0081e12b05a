"""Finds jobs whose worker vanished and jobs whose message was lost, and puts them back in line.

Safe to run in many places at once: every change is a compare-and-set on (id, status, attempt).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from core.states import JobStatus
from models import jobs as jobs_db
from models.db import session_scope
from models.tables import Job, utcnow

log = logging.getLogger(__name__)


def reap(
    sessions: sessionmaker[Session],
    enqueue: Callable[[str], bool],
    queue_depth: Callable[[], int | None],
    resend_after_seconds: float = 60,
) -> dict[str, int]:
    now = utcnow()
    requeued, failed, resent = [], 0, []
    with session_scope(sessions) as s:
        for job in jobs_db.expired_leases(s, now):
            retry = job.attempt < job.max_attempts
            values = (
                {"status": JobStatus.QUEUED, "lease_until": None, "enqueued_at": now}
                if retry
                else {
                    "status": JobStatus.FAILED,
                    "lease_until": None,
                    "finished_at": now,
                    "error_code": "worker_lost",
                    "error_message": f"the worker was lost {job.attempt} times (max_attempts)",
                }
            )
            res = s.execute(
                update(Job)
                .where(Job.id == job.id, Job.status == JobStatus.RUNNING, Job.attempt == job.attempt)
                .values(updated_at=now, **values)
            )
            if res.rowcount != 1:  # type: ignore[attr-defined]
                continue
            if retry:
                requeued.append(job.id)
                msg = (
                    f"worker {job.worker_id} lost during attempt {job.attempt}; retrying from last checkpoint"
                )
                jobs_db.add_event(s, job.id, "retried", msg, {"attempt": job.attempt})
            else:
                failed += 1
                jobs_db.add_event(s, job.id, "failed", values["error_message"], {"code": "worker_lost"})
        # A queued job with nothing in the broker's queue lost its message (e.g. a broker restart).
        if queue_depth() == 0:
            for job in jobs_db.stale_queued(s, now - timedelta(seconds=resend_after_seconds)):
                if job.id not in requeued:
                    resent.append(job.id)
                    jobs_db.mark_enqueued(s, job.id)
    for job_id in requeued + resent:
        enqueue(job_id)
    if requeued or failed or resent:
        log.info("reaper: requeued %d, failed %d, re-sent %d", len(requeued), failed, len(resent))
    return {"requeued": len(requeued), "failed": failed, "resent": len(resent)}
