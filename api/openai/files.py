"""/v1/files: OpenAI's Files API over ftune's datasets (same rows, same stored files, same ids).

An upload is validated by ftune's streaming validator as it arrives, so the answer already says
`processed` (valid) or `error` (with the validator's line-numbered problems in `status_details`).
Everything is scoped to the key's own tenant (the organization), admin keys included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from sqlalchemy.orm import Session

from api.auth import PrincipalDep
from api.deps import Services, ServicesDep, SessionDep
from api.idempotency import IdempotencyKeyHeader
from api.openai.checkpoints import result_csv
from api.openai.errors import AUTHED, OpenAIRoute, documented
from api.openai.job_objects import result_file_id, result_file_job
from api.openai.schemas import PURPOSE, RESULTS_PURPOSE, FileDeleted, FileList, FileObject, file_object
from api.routes.datasets import store_dataset, upload_once
from api.upload import upload_doc
from core.errors import InvalidInput, NotFound
from core.states import JobStatus
from core.storage import Storage
from models import datasets as datasets_db
from models import jobs as jobs_db
from models import tenants as tenants_db
from models.db import session_scope
from models.tables import Dataset, Job
from models.tenants import Principal

router = APIRouter(
    prefix="/files", tags=["openai: files"], route_class=OpenAIRoute, responses=documented(*AUTHED)
)

UPLOAD_DOC = upload_doc({"purpose": {"type": "string", "enum": [PURPOSE]}}, required=["file", "purpose"])


@router.post("", response_model=FileObject, openapi_extra=UPLOAD_DOC, responses=documented(408, 413))
async def create_file(
    request: Request,
    services: ServicesDep,
    principal: PrincipalDep,
    idempotency_key: IdempotencyKeyHeader = None,
) -> JSONResponse:
    """`client.files.create(file=open("data.jsonl", "rb"), purpose="fine-tune")`: a new dataset. A retry
    with the same Idempotency-Key, file and purpose gets the first file back (Idempotent-Replayed: true)."""
    with services.uploads.hold(principal.tenant_id):  # 429 past the tenant's uploads at once
        return await upload_once(
            request,
            services,
            principal,
            idempotency_key,
            scope="POST /v1/files",
            store=_store,
            hashed_fields=("purpose",),
        )


def _store(
    services: Services,
    principal: Principal,
    tmp: Path,
    filename: str,
    fields: dict[str, str],
    report: dict[str, Any],
) -> JSONResponse:
    _check_fields(fields)
    ds = store_dataset(services, principal, tmp, filename, report)
    return JSONResponse(file_object(ds).model_dump(mode="json"))


def _check_fields(fields: dict[str, str]) -> None:
    """`purpose` must be fine-tune; a field ftune cannot honour (`expires_after`) is refused, not ignored."""
    for name in fields:
        if name != "purpose":
            raise InvalidInput(
                f"{name!r} is not supported by ftune: files are kept until deleted",
                code="unsupported_parameter",
                param=name.split("[", 1)[0],
            )
    purpose = fields.get("purpose")
    if purpose != PURPOSE:
        got = "no purpose" if purpose is None else f"purpose {purpose!r}"
        raise InvalidInput(
            f"{got}: ftune stores files for fine-tuning only; send purpose='{PURPOSE}'",
            code="invalid_purpose",
            param="purpose",
        )


@router.get("", response_model=FileList)
def list_files(
    session: SessionDep,
    principal: PrincipalDep,
    after: Annotated[str | None, Query(max_length=200, description="a file id: list past it")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Annotated[Literal["asc", "desc"], Query(description="by created_at")] = "desc",
    purpose: Annotated[str | None, Query(max_length=100)] = None,
) -> FileList:
    """`client.files.list(limit=..., order=..., purpose="fine-tune")`; the SDK pages with `after`."""
    if purpose not in (None, PURPOSE):
        rows: list[Dataset] = []
        more = False
    else:
        rows, more = datasets_db.list_page(
            session, principal.tenant_id, limit=limit, after_id=after, ascending=order == "asc"
        )
    data = [file_object(ds) for ds in rows]
    return FileList(
        data=data,
        has_more=more,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


def _get(session: Session, file_id: str, principal: Principal) -> Dataset:
    ds = datasets_db.get_live_dataset(session, file_id, principal.tenant_id)
    if ds is None:
        raise NotFound(f"no such file: {file_id!r}", code="file_not_found", param="file_id")
    return ds


def _result_job(session: Session, file_id: str, principal: Principal) -> Job | None:
    """The tenant's succeeded job whose result file `file_id` names; None if it names no result file."""
    job_id = result_file_job(file_id)
    if job_id is None:
        return None
    job = jobs_db.get_job(session, job_id, principal.tenant_id)
    if job is None or job.status != JobStatus.SUCCEEDED:
        raise NotFound(f"no such file: {file_id!r}", code="file_not_found", param="file_id")
    return job


def _result_object(job: Job, storage: Storage) -> FileObject:
    size = len(result_csv(job, storage))
    finished = job.finished_at or job.updated_at
    return FileObject(
        id=result_file_id(job.id),
        bytes=size,
        created_at=int(finished.timestamp()),
        filename="step_metrics.csv",
        purpose=RESULTS_PURPOSE,
        status="processed",
        status_details=None,
    )


@router.get("/{file_id}", response_model=FileObject, responses=documented(404))
def retrieve_file(
    file_id: str, services: ServicesDep, session: SessionDep, principal: PrincipalDep
) -> FileObject:
    """A training file, or a job's result file (purpose fine-tune-results, made from its metrics)."""
    if (job := _result_job(session, file_id, principal)) is not None:
        return _result_object(job, services.storage)
    return file_object(_get(session, file_id, principal))


@router.get(
    "/{file_id}/content",
    response_class=FileResponse,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "the file"},
        **documented(404),
    },
)
def file_content(
    file_id: str, services: ServicesDep, session: SessionDep, principal: PrincipalDep
) -> Response:
    """`client.files.content(id)`: the bytes as uploaded, or a job's result CSV."""
    if (job := _result_job(session, file_id, principal)) is not None:
        return Response(result_csv(job, services.storage), media_type="text/csv")
    ds = _get(session, file_id, principal)
    return FileResponse(services.storage.dataset_path(ds.id), media_type="application/octet-stream")


@router.delete("/{file_id}", response_model=FileDeleted, responses=documented(404))
def delete_file(file_id: str, services: ServicesDep, principal: PrincipalDep) -> FileDeleted:
    """Refused (400 file_in_use) while a job that is not finished trains or validates on the file."""
    with session_scope(services.sessions) as s:
        tenants_db.lock_tenant(s, principal.tenant_id)  # one at a time with job inserts that name it
        ds = _get(s, file_id, principal)
        blocking = datasets_db.delete_unless_in_use(s, ds)
        if blocking:
            raise InvalidInput(
                f"file {file_id} is used by {len(blocking)} job(s) that have not finished "
                f"({', '.join(blocking[:5])}); cancel them or wait for them to finish",
                code="file_in_use",
                param="file_id",
            )
    services.storage.dataset_path(file_id).unlink(missing_ok=True)
    return FileDeleted(id=file_id, deleted=True)
