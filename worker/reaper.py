"""Finds jobs whose worker vanished and jobs whose message was lost, and puts them back in line.

Safe to run in many places at once: every change is a transition (compare-and-set on id, status, attempt).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy.orm import Session, sessionmaker

from core.states import JobStatus
from models import jobs as jobs_db
from models import nodes as nodes_db
from models.db import session_scope
from models.tables import utcnow

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
        for job in jobs_db.expired_leases(s, now=now):
            outcome = jobs_db.release_expired(s, job=job)
            if outcome == JobStatus.QUEUED:
                requeued.append(job.id)
            elif outcome == JobStatus.FAILED:
                failed += 1
        nodes_db.release_stale(s, now=now)  # nodes of lost workers and of ended attempts: free again
        # A queued job with nothing in the broker's queue lost its message (e.g. a broker restart).
        if queue_depth() == 0:
            for job in jobs_db.stale_queued(s, now - timedelta(seconds=resend_after_seconds)):
                if job.id not in requeued:
                    resent.append(job.id)
                    jobs_db.mark_enqueued(s, job_id=job.id)
    for job_id in requeued + resent:
        enqueue(job_id)
    if requeued or failed or resent:
        log.info("reaper: requeued %d, failed %d, re-sent %d", len(requeued), failed, len(resent))
    return {"requeued": len(requeued), "failed": failed, "resent": len(resent)}


def release_predecessor(
    sessions: sessionmaker[Session], worker_id: str, enqueue: Callable[[str], bool]
) -> list[str]:
    """At a worker's start: jobs still owned under its own name belong to an earlier process of that
    name that died (one process per name; `ftune up` restarts its worker under one), so they go back in
    line now, to resume from their checkpoints, instead of when their leases expire."""
    released = []
    with session_scope(sessions) as s:
        for job in jobs_db.owned_by(s, worker_id=worker_id):
            if jobs_db.release_expired(s, job=job) == JobStatus.QUEUED:
                released.append(job.id)
    for job_id in released:
        enqueue(job_id)
    if released:
        log.info("released %d jobs of this worker's previous process: %s", len(released), released)
    return released
