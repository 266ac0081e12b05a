"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from api.deps import ServicesDep

router = APIRouter(tags=["health"])


class ReadyOut(BaseModel):
    status: str
    checks: dict[str, bool]


@router.get("/health")
def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/ready",
    response_model=ReadyOut,
    responses={503: {"model": ReadyOut, "description": "The database or the broker does not answer"}},
)
async def ready(services: ServicesDep) -> JSONResponse:
    """Ready when the database and the broker both answer."""

    def check_db() -> bool:
        try:
            with services.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            return True
        except Exception:
            return False

    checks = {
        "database": await run_in_threadpool(check_db),
        "broker": await run_in_threadpool(services.broker_ping),
    }
    ok = all(checks.values())
    return JSONResponse({"status": "ready" if ok else "not_ready", "checks": checks}, 200 if ok else 503)
