"""What a job page shows beyond the job itself: the live event stream, the admitted plan, artifact files."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import FileResponse, Response, StreamingResponse

from api.auth import PrincipalDep
from api.deps import ServicesDep, SessionDep
from api.owned import NATIVE, OwnedJob
from api.responses import AUTHED, errors
from api.sse import open_stream
from core.archive import checkpoint_members, stream_tar_gz
from core.errors import InvalidInput, NotFound
from models.tables import Artifact
from planner import Plan

router = APIRouter(prefix="/jobs", tags=["jobs"], responses=errors(*AUTHED, 404))


def _resume_point(after: int, last_event_id: str | None) -> int:
    """Last-Event-ID (sent by a reconnecting EventSource) wins over the `after` query parameter."""
    if last_event_id is None or not last_event_id.strip():
        return after
    try:
        value = int(last_event_id)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidInput(
            "Last-Event-ID must be an event id (a non-negative integer)", param="Last-Event-ID"
        )
    return value


@router.get(
    "/{job_id}/events/stream",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "server-sent events"}},
)
def stream_events(
    job_id: str,
    request: Request,
    services: ServicesDep,
    principal: PrincipalDep,
    after: Annotated[int, Query(ge=0)] = 0,
    last_event_id: Annotated[str | None, Header(max_length=20)] = None,
) -> StreamingResponse:
    """The job's events as they happen (SSE); ends with an `end` event once the job is terminal. A tenant
    has at most FTUNE_SSE_MAX_STREAMS_PER_TENANT streams open at once (429 `too_many_streams` past it)."""
    # A short session, not SessionDep: that one would hold a connection for the stream's whole life.
    with services.sessions() as s:
        NATIVE.load(s, job_id, principal)  # 404 before any byte is streamed
    start = _resume_point(after, last_event_id)
    return open_stream(services, principal.tenant_id, job_id, start, request.is_disconnected)


@router.get("/{job_id}/plan", response_model=Plan)
def get_plan(
    job: OwnedJob,
    services: ServicesDep,
    stage: Literal["current", "admission"] = "current",
) -> Any:
    """The job's memory plan (itemised), to compare with the measured peak. `current`: the plan it runs
    under, re-made from its data's lengths once its token statistics are ready and on the worker that
    claims it; `admission`: the plan it was admitted on (the worst case: every micro-batch max_seq_len
    tokens)."""
    storage = services.storage
    path = storage.admission_plan_path(job.id) if stage == "admission" else storage.plan_path(job.id)
    if stage == "admission" and not path.is_file():  # admitted before the admission plan was kept apart
        path = storage.plan_path(job.id)
    if not path.is_file():
        raise NotFound(
            f"job {job.id} was admitted without a plan (no worker had reported its devices)",
            code="plan_not_found",
            param="job_id",
        )
    return Plan.model_validate_json(path.read_text())


@router.get(
    "/{job_id}/artifacts/{artifact_id}/download",
    response_class=FileResponse,
    responses={200: {"content": {"application/gzip": {}}, "description": "the artifact as .tar.gz"}},
)
def download_artifact(
    job: OwnedJob, artifact_id: str, session: SessionDep, services: ServicesDep
) -> Response:
    """An adapter archive, or a checkpoint directory as .tar.gz streamed as it is packed: no copy of it is
    written, so downloads at once take no room on the data volume (nor in memory beyond a file's chunk)."""
    art = session.get(Artifact, artifact_id)
    if art is None or art.job_id != job.id:
        raise NotFound(f"artifact {artifact_id!r} not found", code="artifact_not_found", param="artifact_id")
    # relpath was written by the worker from known names (see models.tables.Artifact), never user input.
    path = services.storage.job_dir(job.id) / art.relpath
    name = f"ftune-{job.id[:8]}-{art.relpath.replace('/', '-')}"
    headers = {"X-Checksum-Sha256": art.sha256}
    if path.is_file():
        return FileResponse(path, media_type="application/gzip", filename=name, headers=headers)
    if not path.is_dir():
        raise NotFound(
            f"artifact {artifact_id} is no longer stored (older checkpoints are pruned)",
            code="artifact_gone",
            param="artifact_id",
        )
    headers["Content-Disposition"] = f'attachment; filename="{name}.tar.gz"'
    members = checkpoint_members(path, f"{path.name}/")  # a checkpoint's files (training.checkpoint)
    return StreamingResponse(stream_tar_gz(members), media_type="application/gzip", headers=headers)
