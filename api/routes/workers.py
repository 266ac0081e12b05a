"""The worker fleet: devices, current job, heartbeat age, alive or lost."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from api.auth import AdminDep
from api.deps import SessionDep
from api.responses import AUTHED, errors
from models import workers as workers_db
from models.tables import utcnow

router = APIRouter(prefix="/workers", tags=["workers"], responses=errors(*AUTHED, 403))


class WorkerOut(BaseModel):
    id: str
    hostname: str
    devices: list[dict[str, Any]]
    current_job_id: str | None
    started_at: datetime
    heartbeat_at: datetime
    heartbeat_age_seconds: float
    alive: bool


@router.get("", response_model=list[WorkerOut])
def list_workers(session: SessionDep, _: AdminDep) -> list[WorkerOut]:
    now = utcnow()
    return [
        WorkerOut(
            id=w.id,
            hostname=w.hostname,
            devices=w.devices,
            current_job_id=w.current_job_id,
            started_at=w.started_at,
            heartbeat_at=w.heartbeat_at,
            heartbeat_age_seconds=round((now - w.heartbeat_at).total_seconds(), 1),
            alive=workers_db.is_alive(w, now),
        )
        for w in workers_db.list_workers(session)
    ]
