"""The ops dashboard: one static page (no build step) that polls the JSON API, its scripts and style
(api/static/dashboard/: a file per part of the page), and its summary endpoint."""

from __future__ import annotations

from datetime import datetime
from importlib.resources import files
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel

from api.auth import PrincipalDep, scope
from api.deps import SessionDep
from api.responses import AUTHED, errors
from api.routes.workers import WorkerOut, list_workers
from core.errors import NotFound
from models import stats
from models.tables import utcnow

router = APIRouter(tags=["dashboard"])

# The page's parts by name (text, media type), read from the package once: a request names one of these,
# never a path.
ASSET_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
ASSETS = {
    part.name: (part.read_text(), ASSET_TYPES[part.name[part.name.rfind(".") :]])
    for part in files("api").joinpath("static/dashboard").iterdir()
    if part.name.endswith(tuple(ASSET_TYPES))
}


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
def dashboard() -> HTMLResponse:
    # The page itself is public and holds no data; it asks for a key and every API call sends it.
    return HTMLResponse(files("api").joinpath("static/dashboard.html").read_text())


@router.get("/dashboard/static/{name}", include_in_schema=False)
def dashboard_part(name: str) -> Response:
    if name not in ASSETS:
        raise NotFound(f"no dashboard file {name!r}")
    text, media_type = ASSETS[name]
    return Response(text, media_type=media_type, headers={"Cache-Control": "no-cache"})


@router.get("/", include_in_schema=False, response_class=HTMLResponse)
def root() -> HTMLResponse:
    return dashboard()


class Summary(BaseModel):
    is_admin: bool
    counts: dict[str, int]
    queue_depth: int
    workers: list[WorkerOut] | None  # admins only
    tenants: dict[str, str] | None  # id -> name, admins only
    generated_at: datetime


@router.get("/dashboard/summary", response_model=Summary, responses=errors(*AUTHED))
def summary(session: SessionDep, principal: PrincipalDep) -> Any:
    """Counts by status and queue depth (the caller's own jobs, or all for an admin); the fleet for admins."""
    counts = stats.counts_by_status(session, scope(principal))
    admin = principal.is_admin
    return Summary(
        is_admin=admin,
        counts=counts,
        queue_depth=counts["queued"],
        workers=list_workers(session, principal) if admin else None,
        tenants=stats.tenant_names(session) if admin else None,
        generated_at=utcnow(),
    )
