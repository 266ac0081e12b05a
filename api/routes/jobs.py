"""Jobs: submit (validated and planned before it is queued), inspect, cancel, pause/resume, events,
downloads. Translation only: the work is in models (submission, jobs)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse, JSONResponse
from sqlalchemy.orm import Session

from api.auth import PrincipalDep, scope
from api.deps import Services, ServicesDep, SessionDep
from api.idempotency import IdempotencyKeyHeader, body_hash, run_once
from api.jsonbody import ThreadDecodedRoute
from api.owned import NATIVE, OwnedJob, control_job
from api.responses import AUTHED, errors
from api.schemas import (
    ArtifactOut,
    EventOut,
    EventPage,
    JobOut,
    Page,
    QueueInfo,
    artifact_out,
    event_out,
    job_out,
)
from core.errors import Conflict, NotFound
from core.run_protocol import EvalRecord, StepRecord, read_records
from core.spec import JobSpec
from core.states import JobStatus
from models import jobs as jobs_db
from models import openai_jobs
from models.queue_view import queue_view
from models.tables import Job
from models.tenants import Principal

router = APIRouter(prefix="/jobs", tags=["jobs"], responses=errors(*AUTHED), route_class=ThreadDecodedRoute)


@router.post("", status_code=202, response_model=JobOut, responses=errors(400, 409, 413))
def create_job(
    spec: JobSpec,
    services: ServicesDep,
    principal: PrincipalDep,
    idempotency_key: IdempotencyKeyHeader = None,
) -> JSONResponse:
    """Validate the spec, check it fits, store the job, then wake a worker (after the commit)."""
    body = spec.model_dump(mode="json")
    scope_key = f"{principal.tenant_id} POST /jobs"
    return run_once(
        services, scope_key, idempotency_key, body_hash(body), lambda: _create_job(spec, services, principal)
    )


def _create_job(spec: JobSpec, services: Services, principal: Principal) -> JSONResponse:
    job = services.submit(spec, tenant_id=principal.tenant_id)
    out = job_out(job).model_dump(mode="json")
    return JSONResponse(out, 202, headers={"Location": f"/jobs/{job.id}"})


@router.get("", response_model=Page[JobOut])
def list_jobs(
    session: SessionDep,
    principal: PrincipalDep,
    status: JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    after: Annotated[str | None, Query(max_length=200)] = None,
) -> Page[JobOut]:
    rows, cursor = jobs_db.list_jobs(session, limit, after, status, scope(principal))
    return Page[JobOut](data=[job_out(j) for j in rows], has_more=cursor is not None, next_cursor=cursor)


@router.get("/{job_id}", response_model=JobOut, responses=errors(404))
def get_job(job: OwnedJob, session: SessionDep, services: ServicesDep) -> JobOut:
    entry = queue_view(session, services.placer).get(job.id) if job.status == "queued" else None
    return job_out(job, QueueInfo(**asdict(entry)) if entry else None)


@router.post("/{job_id}/cancel", status_code=202, response_model=JobOut, responses=errors(404, 409))
def cancel_job(job_id: str, services: ServicesDep, principal: PrincipalDep) -> JobOut:
    """Cancel: a queued or paused job at once; a running one stops after its current step and saves a
    checkpoint."""
    return control_job("cancel", job_id, services, principal, NATIVE, job_out)


@router.post("/{job_id}/pause", status_code=202, response_model=JobOut, responses=errors(404, 409))
def pause_job(job_id: str, services: ServicesDep, principal: PrincipalDep) -> JobOut:
    """Pause: a queued job at once (`paused`); a running one is `pausing` until it has saved a checkpoint
    after its current step and stopped (`paused`). POST /jobs/{id}/resume continues it from there."""
    return control_job("pause", job_id, services, principal, NATIVE, job_out)


@router.post("/{job_id}/resume", status_code=202, response_model=JobOut, responses=errors(404, 409))
def resume_job(job_id: str, services: ServicesDep, principal: PrincipalDep) -> JobOut:
    """Resume a paused job: it is queued again and continues from its last checkpoint."""
    return control_job("resume", job_id, services, principal, NATIVE, job_out)


@router.delete("/{job_id}", response_model=JobOut, responses=errors(404, 409))
def delete_job(job_id: str, services: ServicesDep, principal: PrincipalDep) -> JobOut:
    """Delete a finished job's files (checkpoints, adapter, metrics, logs); its record stays, marked
    deleted, so audits and the dashboard still show it. A job that has not finished: 409 job_not_finished."""
    with services.sessions() as s:
        NATIVE.load(s, job_id, principal)  # the caller's, or 404
    deleted = services.delete_finished_job(job_id)
    with services.sessions() as s:
        job = NATIVE.load(s, job_id, principal)
        if not deleted:
            raise Conflict(
                f"job {job_id} is {job.status}; cancel it or wait for it to finish before deleting it",
                code="job_not_finished",
                param="job_id",
                details={"status": job.status},
            )
        return job_out(job)


@router.get("/{job_id}/events", response_model=EventPage, responses=errors(404))
def list_events(
    job: OwnedJob,
    session: SessionDep,
    after: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> EventPage:
    rows, has_more = jobs_db.list_events(session, job.id, after, limit)
    data: list[EventOut] = [event_out(e) for e in rows]
    return EventPage(data=data, has_more=has_more, next_after=data[-1].id if data else None)


@router.get("/{job_id}/metrics", responses=errors(404))
def get_metrics(
    job: OwnedJob,
    services: ServicesDep,
    after_step: Annotated[int, Query(ge=0)] = 0,
) -> dict[str, Any]:
    """The per-step training records (loss, lr, grad_norm, tokens/s, ...) in `data` and the
    validation records (eval_loss, eval_token_accuracy) in `eval`, for curves."""
    records = read_records(services.storage.metrics_path(job.id))  # as they stand after every resume
    steps = [r.model_dump(mode="json") for r in records if isinstance(r, StepRecord) and r.step > after_step]
    evals = [r.model_dump(mode="json") for r in records if isinstance(r, EvalRecord) and r.step > after_step]
    return {"data": steps, "eval": evals}


@router.get("/{job_id}/samples", responses=errors(404))
def get_samples(job: OwnedJob, services: ServicesDep) -> dict[str, Any]:
    """Before/after samples (spec.sample_prompts): `latest` is the newest set (the end's once the job
    has finished), `sets` every set in order (each evaluation's with sample_at_eval, then the end's);
    each set is {step, at: eval|end, items: [{prompt, base, tuned}]}. None yet: latest null, sets []."""
    path = services.storage.samples_path(job.id)  # written atomically by the worker from the records
    sets = json.loads(path.read_text())["sets"] if path.is_file() else []
    return {"job_id": job.id, "latest": sets[-1] if sets else None, "sets": sets}


@router.get("/{job_id}/artifacts", response_model=list[ArtifactOut], responses=errors(404))
def list_artifacts(job: OwnedJob, session: SessionDep, services: ServicesDep) -> list[ArtifactOut]:
    """What the job still stores, to download: the adapter (and merged model), then its checkpoints newest
    first, each with the loss (and eval loss) logged at its step. Checkpoints pruned by keep_checkpoints
    are left out, so this list, the dashboard and the /v1 checkpoints list agree."""
    job_dir = services.storage.job_dir(job.id)
    finals = [a for a in job.artifacts if a.kind != "checkpoint" and openai_jobs.is_stored(a, job_dir)]
    finals.sort(key=lambda a: a.created_at, reverse=True)
    kept = openai_jobs.stored_checkpoints(session, job.id, job_dir)[::-1]
    records = read_records(services.storage.metrics_path(job.id)) if kept else []
    losses = {r.step: r.loss for r in records if isinstance(r, StepRecord)}
    evals = {r.step: r.eval_loss for r in records if isinstance(r, EvalRecord)}
    checkpoints = [artifact_out(a, losses.get(a.step or 0), evals.get(a.step or 0)) for a in kept]
    return [artifact_out(a) for a in finals] + checkpoints


@router.get(
    "/{job_id}/adapter",
    response_class=FileResponse,
    responses={
        200: {"content": {"application/gzip": {}}, "description": "adapter .tar.gz"},
        **errors(404, 409),
    },
)
def download_adapter(job: OwnedJob, session: SessionDep, services: ServicesDep) -> FileResponse:
    """The trained adapter as .tar.gz: adapter_config.json, adapter_model.safetensors, README.md."""
    return _archive_response(session, job, "adapter", services.storage.adapter_archive(job.id))


@router.get(
    "/{job_id}/merged",
    response_class=FileResponse,
    responses={
        200: {"content": {"application/gzip": {}}, "description": "merged model .tar.gz"},
        **errors(404, 409),
    },
)
def download_merged(job: OwnedJob, session: SessionDep, services: ServicesDep) -> FileResponse:
    """The base model with the adapter merged in (`export: merged`) as .tar.gz: config.json,
    model.safetensors, tokenizer files. Loads with AutoModelForCausalLM.from_pretrained."""
    if job.spec.get("export") != "merged":
        raise Conflict(
            f'job {job.id} was not asked for a merged export (set "export": "merged")',
            code="merged_not_requested",
            param="job_id",
        )
    return _archive_response(session, job, "merged", services.storage.merged_archive(job.id))


def _archive_response(session: Session, job: Job, kind: str, path: Path) -> FileResponse:
    """A finished job's archive of `kind`, or 409 <kind>_not_ready while it is not there yet."""
    if job.deleted_at is not None:
        raise NotFound(f"job {job.id} was deleted with its files", code=f"{kind}_deleted", param="job_id")
    art = jobs_db.find_artifact(session, job.id, kind)
    if job.status != JobStatus.SUCCEEDED or art is None:
        raise Conflict(
            f"job {job.id} is {job.status}; the {kind} download is available once it has succeeded",
            code=f"{kind}_not_ready",
            param="job_id",
        )
    return FileResponse(
        path,
        media_type="application/gzip",
        filename=f"ftune-{kind}-{job.id}.tar.gz",
        headers={"X-Checksum-Sha256": art.sha256},
    )
