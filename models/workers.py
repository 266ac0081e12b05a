"""Queries on the worker fleet."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from models.tables import Worker, utcnow

ALIVE_SECONDS = 90  # three missed heartbeats


def register(session: Session, worker_id: str, hostname: str, devices: list[dict[str, Any]]) -> None:
    now = utcnow()
    w = session.get(Worker, worker_id)
    if w is None:
        session.add(
            Worker(id=worker_id, hostname=hostname, devices=devices, started_at=now, heartbeat_at=now)
        )
    else:
        w.hostname, w.devices, w.started_at, w.heartbeat_at, w.stopped = hostname, devices, now, now, False


def heartbeat(session: Session, worker_id: str) -> None:
    session.execute(update(Worker).where(Worker.id == worker_id).values(heartbeat_at=utcnow()))


def set_current_job(session: Session, worker_id: str, job_id: str | None) -> None:
    session.execute(
        update(Worker).where(Worker.id == worker_id).values(current_job_id=job_id, heartbeat_at=utcnow())
    )


def mark_stopped(session: Session, worker_id: str) -> None:
    session.execute(update(Worker).where(Worker.id == worker_id).values(stopped=True, current_job_id=None))


def list_workers(session: Session) -> list[Worker]:
    return list(session.scalars(select(Worker).order_by(Worker.heartbeat_at.desc())).all())


def fleet(session: Session, seen_within: timedelta = timedelta(days=1)) -> list[Worker]:
    """Workers seen recently, alive or not: a job may wait in the queue for a worker to come back."""
    since = utcnow() - seen_within
    return list(session.scalars(select(Worker).where(Worker.heartbeat_at >= since)).all())


def is_alive(worker: Worker, now: datetime | None = None) -> bool:
    now = now or utcnow()
    return not worker.stopped and (now - worker.heartbeat_at).total_seconds() < ALIVE_SECONDS
