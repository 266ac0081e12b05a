"""Passing a wake-up on: the worker that takes a job's message from the shared queue and cannot run that
job wakes the class queues of the live workers that can (core.queues), or records why the job waits.

Refreshing waiting reasons: a job no live worker fits, or a multi-node job too few of them have room for,
gets a `waiting` event whenever its reason changes (a worker stops, another registers, one frees up), run
on every reaper pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from core.queues import class_queue
from core.states import JobStatus
from models import fairshare
from models import jobs as jobs_db
from models import nodes as nodes_db
from models import workers as workers_db
from models.db import session_scope
from models.placement import Placer, fitting_workers, note_waiting, waiting_reason

log = logging.getLogger(__name__)


def pass_on(
    sessions: sessionmaker[Session],
    placer: Placer,
    devices: list[dict[str, Any]],
    job_id: str,
    send: Callable[[str, str], bool],
) -> list[str]:
    """If `job_id` is queued and does not fit `devices`, wake the class queues of the live workers it
    fits (returned), or record why it waits. Nothing when it fits here: this worker claims next."""
    with session_scope(sessions) as s:
        job = jobs_db.get_job(s, job_id)
        if job is None or job.status != JobStatus.QUEUED or placer.fits(job, devices):
            return []
        fleet = workers_db.fleet(s)
        alive = [w for w in fleet if workers_db.is_alive(w)]
        queues = sorted({class_queue(w.devices) for w in fitting_workers(placer, job, alive)})
        if not queues:
            note_waiting(s, job, waiting_reason(placer, job, fleet, free=nodes_db.with_room(s)))
    for queue in queues:
        send(queue, job_id)
    if queues:
        log.info("job %s does not fit this worker; woke %s", job_id, ", ".join(queues))
    return queues


def refresh_waiting(sessions: sessionmaker[Session], placer: Placer) -> int:
    """Record the reason of every queued job that cannot start now (models.placement.waiting_reason), when
    it changed. Returns how many events were added."""
    added = 0
    with session_scope(sessions) as s:
        fleet = workers_db.fleet(s)
        free = nodes_db.with_room(s)
        for job in fairshare.queued_jobs(s):
            added += note_waiting(s, job, waiting_reason(placer, job, fleet, free=free))
    return added
