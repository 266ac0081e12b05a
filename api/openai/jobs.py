"""/v1/fine_tuning/jobs: OpenAI's fine-tuning jobs over ftune's jobs (same rows, services and ids).

A create goes through models.submission.submit_job, exactly like POST /jobs: quota, admission (an
infeasible job is a 400 whose `details` has the planner's breakdown and suggestions), plan, enqueue after
commit. Cancel, pause and resume are the native transitions. Everything is scoped to the key's own tenant.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from api.auth import PrincipalDep
from api.deps import Services, ServicesDep, SessionDep
from api.idempotency import IdempotencyKeyHeader, body_hash, run_once
from api.openai import events as events_view
from api.openai.checkpoints import CheckpointList, checkpoint_objects
from api.openai.errors import AUTHED, OpenAIRoute, documented
from api.openai.hyperparameters import (
    AUTO_BATCH_KEY,
    OPENAI_PARAM,
    CreateJobRequest,
    Mapped,
    build_spec,
    map_request,
    per_gpu_batch,
    resolved,
)
from api.openai.job_objects import FineTuningJob, FineTuningJobList, job_object
from api.owned import FINE_TUNING, Action, OwnedFineTuningJob, control_job
from core import ft_names
from core.errors import FtuneError, InvalidInput, NotFound
from core.spec import JobSpec
from core.states import JobStatus
from models import datasets as datasets_db
from models import jobs as jobs_db
from models import openai_jobs
from models.auto_batch import split_batch
from models.submission import OpenAIFields
from models.tenants import Principal

router = APIRouter(
    prefix="/fine_tuning/jobs",
    tags=["openai: fine-tuning"],
    route_class=OpenAIRoute,
    responses=documented(*AUTHED),
)


@router.post("", response_model=FineTuningJob, responses=documented(413))  # 413: the storage quota
def create_job(
    body: CreateJobRequest,
    services: ServicesDep,
    principal: PrincipalDep,
    idempotency_key: IdempotencyKeyHeader = None,
) -> JSONResponse:
    """`client.fine_tuning.jobs.create(model=..., training_file=..., ...)`; a retry with the same
    Idempotency-Key and body gets the first answer (header Idempotent-Replayed: true), not a second job."""
    scope_key = f"{principal.tenant_id} POST /v1/fine_tuning/jobs"
    request_hash = body_hash(body.model_dump(mode="json"))
    return run_once(
        services, scope_key, idempotency_key, request_hash, lambda: _create(body, services, principal)
    )


def _create(body: CreateJobRequest, services: Services, principal: Principal) -> JSONResponse:
    try:
        with services.sessions() as s:
            base_model, init_from, init_step = _resolve_model(s, body.model, principal, services)
        mapped = map_request(body, base_model, init_from)
        if init_step is not None:  # a checkpoint's model: that checkpoint's adapter, not the final one
            mapped.fields["init_from_step"] = init_step
        spec = build_spec(mapped.fields)
        examples = None
        if mapped.batch_size is not None:
            spec, examples = _with_batch(spec, mapped, services, principal)
        request: dict[str, Any] = {"model": body.model, **resolved(spec, mapped.method_type, mapped.echo)}
        if examples is not None:  # batch_size auto, from the file's size: the hyperparameters event says so
            request[AUTO_BATCH_KEY] = {"training_examples": examples}
        fields = OpenAIFields(suffix=body.suffix, metadata=body.metadata, request=request)
        job = services.submit(spec, tenant_id=principal.tenant_id, openai=fields)
    except FtuneError as e:  # admission names JobSpec's fields; the caller sent OpenAI's
        if e.code != "duplicate_parameter":  # that one names the extra field the caller sent
            e.param = OPENAI_PARAM.get(e.param or "", e.param)
        if e.code == "dataset_not_found":  # missing, or another organization's: 404 as OpenAI answers
            raise NotFound(
                f"no such file in this organization ({e.param})", code="file_not_found", param=e.param
            ) from e
        raise
    return JSONResponse(job_object(job, services.storage).model_dump(mode="json"))


def _with_batch(
    spec: JobSpec, mapped: Mapped, services: Services, principal: Principal
) -> tuple[JobSpec, int | None]:
    """(`spec` with batch_size examples per step, split into the planner's largest micro-batch that fits
    x accumulation; the training file's examples when auto chose the batch from them). Reinforcement's
    auto: JobSpec's default step."""
    batch = mapped.batch_size
    assert batch is not None  # the caller's check: None means the split was given as fields
    with services.sessions() as s:
        examples = None
        if batch == "auto" and mapped.method_type != "reinforcement":
            ds = datasets_db.get_live_dataset(s, spec.dataset_id, principal.tenant_id)
            examples = ds.num_examples if ds is not None else None  # missing: admission refuses it
        per_gpu = per_gpu_batch(batch, spec.num_gpus, examples)
        spec = build_spec(mapped.fields | {"examples_per_step": per_gpu * spec.num_gpus})
        split = split_batch(
            s,
            catalog=services.catalog,
            spec=spec,
            per_gpu=per_gpu,
            tenant_id=principal.tenant_id,
            plan_gpu=services.settings.plan_gpu,
        )
        return split, examples


def _resolve_model(
    session: Session, model: str, principal: Principal, services: Services
) -> tuple[str, str | None, int | None]:
    """(base model, job to continue from, its checkpoint's step): a base model name, or a fine-tuned model
    (or a checkpoint's, `...:ckpt-step-N`) of the caller's own."""
    if not ft_names.is_fine_tuned(model):
        return model, None, None
    name = ft_names.parse(model)
    source = jobs_db.get_job(session, name.job_id, principal.tenant_id) if name is not None else None
    if name is None or source is None or source.status != JobStatus.SUCCEEDED:
        raise InvalidInput(
            f"model {model!r} is not a fine-tuned model of this organization that finished successfully",
            code="model_not_found",
            param="model",
        )
    if name.step is not None:
        saved = openai_jobs.checkpoint(session, source.id, name.step)
        kept = saved is not None and openai_jobs.is_stored(saved, services.storage.job_dir(source.id))
        if not kept:  # never saved, or pruned by the job's keep_checkpoints
            raise InvalidInput(
                f"job {source.id} keeps no checkpoint at step {name.step}; see "
                f"GET /v1/fine_tuning/jobs/{source.id}/checkpoints",
                code="checkpoint_not_found",
                param="model",
            )
    return source.base_model, source.id, name.step


def _metadata_filter(request: Request) -> dict[str, str]:
    """`metadata[k]=v` query parameters (the SDK's `extra_query={"metadata[k]": "v"}`)."""
    out = {}
    for key, value in request.query_params.multi_items():
        if key.startswith("metadata[") and key.endswith("]"):
            out[key[len("metadata[") : -1]] = value
    return out


@router.get("", response_model=FineTuningJobList)
def list_jobs(
    request: Request,
    services: ServicesDep,
    session: SessionDep,
    principal: PrincipalDep,
    after: Annotated[str | None, Query(max_length=200, description="a job id: list past it")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> FineTuningJobList:
    """Newest first; `client.fine_tuning.jobs.list()` walks every page with `after`."""
    rows, more = openai_jobs.list_page(
        session, principal.tenant_id, limit=limit, after_id=after, metadata=_metadata_filter(request)
    )
    return FineTuningJobList(data=[job_object(j, services.storage) for j in rows], has_more=more)


@router.get("/{job_id}", response_model=FineTuningJob, responses=documented(404))
def retrieve_job(job: OwnedFineTuningJob, services: ServicesDep) -> FineTuningJob:
    return job_object(job, services.storage)


@router.post("/{job_id}/cancel", response_model=FineTuningJob, responses=documented(404))
def cancel_job(job_id: str, services: ServicesDep, principal: PrincipalDep) -> FineTuningJob:
    """A queued or paused job is cancelled at once; a running one after its current step. A finished job
    is a 400 (a retry cannot change it)."""
    return _control("cancel", job_id, services, principal)


@router.post("/{job_id}/pause", response_model=FineTuningJob, responses=documented(404))
def pause_job(job_id: str, services: ServicesDep, principal: PrincipalDep) -> FineTuningJob:
    """A queued job pauses at once; a running one checkpoints after its current step and then shows paused
    (until then: running)."""
    return _control("pause", job_id, services, principal)


@router.post("/{job_id}/resume", response_model=FineTuningJob, responses=documented(404))
def resume_job(job_id: str, services: ServicesDep, principal: PrincipalDep) -> FineTuningJob:
    """A paused job goes back to the queue and continues from its checkpoint."""
    return _control("resume", job_id, services, principal)


def _control(action: Action, job_id: str, services: Services, principal: Principal) -> FineTuningJob:
    """api.owned.control_job in OpenAI's shape (its Conflict answers 400 here)."""
    return control_job(
        action, job_id, services, principal, FINE_TUNING, lambda job: job_object(job, services.storage)
    )


@router.get("/{job_id}/events", response_model=events_view.EventList, responses=documented(404))
def list_events(
    job: OwnedFineTuningJob,
    services: ServicesDep,
    after: Annotated[str | None, Query(max_length=200, description="an event id: list older ones")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> events_view.EventList:
    """Newest first: ftune's job events (`message`) and a `metrics` event per logged step."""
    rows, more = events_view.page(events_view.job_events(job, services.storage), after, limit)
    return events_view.EventList(data=rows, has_more=more)


@router.get("/{job_id}/checkpoints", response_model=CheckpointList, responses=documented(404))
def list_checkpoints(
    job: OwnedFineTuningJob,
    services: ServicesDep,
    session: SessionDep,
    after: Annotated[str | None, Query(max_length=200, description="a checkpoint id: list past it")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 10,
) -> CheckpointList:
    """The checkpoints ftune keeps on disk (JobSpec keep_checkpoints: the newest N plus the best by eval
    loss), in step order."""
    kept = openai_jobs.stored_checkpoints(session, job.id, services.storage.job_dir(job.id))
    objects = checkpoint_objects(job, kept, services.storage)
    ids = [c.id for c in objects]
    start = (ids.index(after) + 1 if after in ids else len(ids)) if after is not None else 0
    data = objects[start : start + limit]
    return CheckpointList(
        data=data,
        has_more=start + limit < len(objects),
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )
