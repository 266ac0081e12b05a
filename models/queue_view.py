"""Where each queued job stands: its position among the jobs ahead of it on the workers that can run it,
an estimated start, and why it waits when no live worker can run it (or, for a multi-node job, when too
few of those that can have room now).

The order is the fair policy's (models.fairshare.rank over all queued jobs). The estimate plays that
order out on the live workers that fit each job: a worker is free when its running job's ETA is up (now
when idle), and each job ahead holds the worker it lands on for a typical duration (the median of
recent successful runs). Without such a history only a job that starts on an idle worker gets one. A
job of N nodes starts when the N-th of its workers is free, and holds all N.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.states import JobStatus
from models import fairshare
from models import nodes as nodes_db
from models import workers as workers_db
from models.placement import Placer, fitting_workers, waiting_reason
from models.tables import Job, utcnow

HISTORY = 50  # recent successful runs the typical duration is taken from


@dataclass(frozen=True)
class QueueEntry:
    position: int | None  # 1: next on the workers that can run it; None: none alive can
    estimated_start: datetime | None
    waiting_reason: str | None


def typical_run_seconds(session: Session) -> float | None:
    rows = session.execute(
        select(Job.started_at, Job.finished_at)
        .where(Job.status == JobStatus.SUCCEEDED, Job.started_at.is_not(None), Job.finished_at.is_not(None))
        .order_by(Job.finished_at.desc())
        .limit(HISTORY)
    ).all()
    seconds = [(f - s).total_seconds() for s, f in rows if f is not None and s is not None]
    return statistics.median(seconds) if seconds else None


def queue_view(session: Session, placer: Placer, now: datetime | None = None) -> dict[str, QueueEntry]:
    now = now or utcnow()
    queued = fairshare.queued_jobs(session)
    if not queued:
        return {}
    fleet = workers_db.fleet(session)
    alive = [w for w in fleet if workers_db.is_alive(w, now)]
    ranked = [
        job
        for _, job in fairshare.rank(
            queued, fairshare.running_per_tenant(session), fairshare.last_start_per_tenant(session)
        )
    ]
    typical = typical_run_seconds(session)
    free = nodes_db.with_room(session)
    free_at: dict[str, datetime | None] = {}  # None: unknown
    for w in alive:
        running = session.get(Job, w.current_job_id) if w.current_job_id else None
        eta = running.eta_seconds if running is not None else 0.0
        eta = eta if eta is not None else typical
        free_at[w.id] = now + timedelta(seconds=eta) if eta is not None else None
    seen: list[set[str]] = []
    out: dict[str, QueueEntry] = {}
    for job in ranked:
        mine = {w.id for w in fitting_workers(placer, job, alive)}
        reason = waiting_reason(placer, job, fleet, free=free)
        if not mine:
            out[job.id] = QueueEntry(None, None, reason)
            continue
        position = 1 + sum(1 for ahead in seen if ahead & mine)
        seen.append(mine)
        nodes = nodes_db.num_nodes(job)
        known = sorted((at, wid) for wid in mine if (at := free_at[wid]) is not None)[:nodes]
        start = known[-1][0] if len(known) == nodes else None
        if start is not None:  # the job holds its workers (one, or all its nodes) for a typical run
            for _, wid in known:
                free_at[wid] = start + timedelta(seconds=typical) if typical is not None else None
        out[job.id] = QueueEntry(position, start, reason)
    return out
