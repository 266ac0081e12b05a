"""A kept checkpoint of a job, downloadable: GET /jobs/{id}/checkpoints/{step} (the /v1 checkpoints list
names them). The whole state as training saved it: adapter.safetensors (the trainable weights by
parameter name), optimizer.safetensors (or, from an FSDP run, shards/: each rank's slices), rng.safetensors
and state.json; nothing pickled."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from api.deps import ServicesDep, SessionDep
from api.owned import OwnedJob
from api.responses import AUTHED, errors
from core.archive import checkpoint_members, stream_tar_gz
from core.errors import NotFound
from models import openai_jobs

router = APIRouter(prefix="/jobs", tags=["jobs"], responses=errors(*AUTHED))


@router.get(
    "/{job_id}/checkpoints/{step}",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/gzip": {}}, "description": "checkpoint .tar.gz"},
        **errors(404),
    },
)
def download_checkpoint(
    job: OwnedJob, step: int, session: SessionDep, services: ServicesDep
) -> StreamingResponse:
    job_dir = services.storage.job_dir(job.id)
    kept = [a for a in openai_jobs.checkpoints(session, job.id) if a.step == step]
    path = job_dir / kept[0].relpath if kept else None
    # relpath was written by the worker under the job's directory; checked again before reading.
    if path is None or not path.resolve().is_relative_to(job_dir.resolve()) or not path.is_dir():
        raise NotFound(
            f"job {job.id} keeps no checkpoint at step {step} (see keep_checkpoints)",
            code="checkpoint_not_found",
            param="step",
        )
    name = f"ftune-checkpoint-{job.id}-step-{step}"
    return StreamingResponse(
        stream_tar_gz(checkpoint_members(path, f"{name}/")),
        media_type="application/gzip",
        headers={"Content-Disposition": f'attachment; filename="{name}.tar.gz"'},
    )
