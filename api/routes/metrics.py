"""GET /metrics in the Prometheus text format (admin key: it shows every tenant's numbers)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.auth import AdminDep
from api.responses import AUTHED, errors

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}}, **errors(*AUTHED, 403)},
)
def metrics(request: Request, _: AdminDep) -> Response:
    """Jobs by status, queue depth, job durations, tokens/s, worker liveness, API request latency."""
    return Response(generate_latest(request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)
