"""Datasets: streaming JSONL upload with validation, listing, details."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api.auth import PrincipalDep, scope
from api.deps import Services, ServicesDep, SessionDep
from api.errors import error_body
from api.idempotency import IdempotencyKeyHeader, body_hash, check_replay_body, replayed
from api.responses import AUTHED, errors
from api.schemas import DatasetOut, Page, dataset_out
from api.upload import FILE_FIELD, FileSink, parse_column_mapping, receive, upload_doc
from core.data.validate import DatasetValidator
from core.errors import Conflict, NotFound, PayloadTooLarge
from core.image_fetch import ImageFetcher
from core.storage import new_id
from models import datasets as datasets_db
from models import idempotency as idem
from models import job_files as job_files_db
from models import tenants as tenants_db
from models.db import session_scope
from models.tables import Dataset
from models.tenants import Principal

router = APIRouter(prefix="/datasets", tags=["datasets"], responses=errors(*AUTHED))
SCOPE = "POST /datasets"

UPLOAD_DOC = upload_doc(
    {"column_mapping": {"type": "string", "description": 'JSON, e.g. {"question": "prompt"}'}},
    required=["file"],
    other_content={"application/x-ndjson": {"schema": {"type": "string", "format": "binary"}}},
)


@router.post(
    "",
    status_code=201,
    response_model=DatasetOut,
    openapi_extra=UPLOAD_DOC,
    responses=errors(408, 409, 413),
)
async def upload_dataset(
    request: Request,
    services: ServicesDep,
    principal: PrincipalDep,
    idempotency_key: IdempotencyKeyHeader = None,
) -> JSONResponse:
    """Upload a JSONL dataset: `curl -F file=@data.jsonl http://127.0.0.1:8000/datasets`.

    The file is validated line by line as it streams in. A file with problems is stored with status
    `invalid` (so its report can be fetched) and answered with 422 listing the problems by line.
    """
    # Every database call runs in a worker thread (run_in_threadpool): a slow or locked database must
    # not stop this event loop from serving other requests and streaming other uploads.
    with services.uploads.hold(principal.tenant_id):  # 429 past the tenant's uploads at once
        return await upload_once(request, services, principal, idempotency_key, scope=SCOPE, store=_store)


# Stores a received, validated upload: (services, principal, temp file, filename, form fields, report).
StoreUpload = Callable[[Services, Principal, Path, str, dict[str, str], dict[str, Any]], JSONResponse]


async def upload_once(
    request: Request,
    services: Services,
    principal: Principal,
    key: str | None,
    *,
    scope: str,
    store: StoreUpload,
    hashed_fields: tuple[str, ...] = (),
) -> JSONResponse:
    """Receive, validate and `store` an upload, at most once per Idempotency-Key in `scope` (a route): a
    retry with the same file (and `hashed_fields` of the form) gets the first answer back."""
    scope_key = f"{principal.tenant_id} {scope}"
    claimed = await run_in_threadpool(idem.claim, services.sessions, scope_key, key, None) if key else None
    owner = claimed if isinstance(claimed, idem.Owner) else None
    tmp = services.storage.temp_file()
    try:
        room = await run_in_threadpool(upload_room, services, principal)
        filename, fields, report, received_sha256 = await receive_and_validate(
            request, services, tmp, room, principal.tenant_id
        )
        # The bytes received, not those stored: a retry of the same upload whose image URLs now serve
        # other bytes is still the same request.
        hashed = {"sha256": received_sha256, "column_mapping": report["column_mapping"], "filename": filename}
        request_hash = body_hash(hashed | {k: fields.get(k) for k in hashed_fields})
        if key and claimed is not None and not isinstance(claimed, idem.Owner):  # a replay
            await run_in_threadpool(check_replay_body, services, scope_key, key, request_hash)
            return replayed(*claimed)
        response = await run_in_threadpool(store, services, principal, tmp, filename, fields, report)
    except BaseException:
        if owner is not None:
            with anyio.CancelScope(shield=True):  # also when the client went away (a cancellation)
                await run_in_threadpool(idem.release, services.sessions, owner)
        raise
    finally:
        tmp.unlink(missing_ok=True)
    if owner is not None:
        body = json.loads(bytes(response.body))
        await run_in_threadpool(
            idem.finish, services.sessions, owner, request_hash, response.status_code, body
        )
    return response


def upload_room(services: Services, principal: Principal) -> int:
    """Bytes this upload may use: the upload limit, or less when the tenant's storage quota (its datasets
    and its jobs' files, models.job_files) is nearly full."""
    settings = services.settings
    with session_scope(services.sessions) as s:
        job_files_db.measure_finished(s, services.storage, principal.tenant_id)
        used = tenants_db.stored_bytes(s, principal.tenant_id)
    left = settings.max_stored_bytes_per_tenant - used
    if left <= 0:
        raise PayloadTooLarge(
            f"the storage quota of {settings.max_stored_bytes_per_tenant} bytes is used up",
            code="storage_quota_exceeded",
            param="file",
        )
    return min(settings.max_upload_bytes, left)


async def receive_and_validate(
    request: Request, services: Services, tmp: Path, max_bytes: int, tenant_id: str
) -> tuple[str, dict[str, str], dict[str, Any], str]:
    """Stream the upload into `tmp` through the validator: (filename, the form's other fields, report, the
    sha256 of the bytes received). Where the operator enables image fetching, a chat row's image URLs are
    fetched as its line is checked, and a valid upload is stored with them inlined (`tmp` rewritten:
    core.data.validate), within `max_bytes` as stored."""
    settings = services.settings
    mapping = parse_column_mapping(request.query_params.get("column_mapping"))

    # One fetcher for both passes: the second answers the URLs the first fetched from memory.
    fetch = ImageFetcher.from_settings(settings, tenant_id, max_fetches=settings.image_fetch_max_per_upload)

    def validator_for(mapping: dict[str, str] | None) -> DatasetValidator:
        return DatasetValidator.from_settings(settings, mapping, spill_dir=tmp.parent, fetch_image=fetch)

    validator = validator_for(mapping)
    sink = FileSink(tmp, validator.feed, max_bytes)
    try:
        upload = await receive(request, sink, settings.upload_idle_timeout_seconds)
    finally:
        sink.close()
    # Off the event loop: finishing sorts the duplicate hashes, and a re-validation reads the whole file.
    if mapping is None and "column_mapping" in upload.fields:
        # A mapping sent as a form field is known only once the form is parsed: validate again from disk.
        mapping = parse_column_mapping(upload.fields["column_mapping"])
        validator = validator_for(mapping)
        await run_in_threadpool(validator.feed_file, tmp)
    received_sha256 = (await run_in_threadpool(validator.finish)).sha256
    report = (await run_in_threadpool(validator.stored, tmp)).model_dump(mode="json")
    if report["size_bytes"] > max_bytes:
        raise PayloadTooLarge(
            f"with its fetched images inlined the upload is {report['size_bytes']} bytes, over the limit of "
            f"{max_bytes} bytes",
            param=FILE_FIELD,
            details={"max_bytes": max_bytes},
        )
    report["column_mapping"] = mapping
    return upload.filename, upload.fields, report, received_sha256


def store_dataset(
    services: Services, principal: Principal, tmp: Path, filename: str, report: dict[str, Any]
) -> Dataset:
    """Move the validated upload into place under a new id and record it (valid or invalid), if the
    tenant's storage quota has room for it: decided under the tenant's lock (models.tenants), so uploads
    that finish together cannot all fit in the same room (upload_room only bounds each one's size)."""
    dataset_id = new_id()
    path = services.storage.dataset_path(dataset_id)
    quota = services.settings.max_stored_bytes_per_tenant
    try:
        with session_scope(services.sessions) as s:
            tenants_db.lock_tenant(s, principal.tenant_id)
            tenants_db.check_storage_room(s, principal.tenant_id, report["size_bytes"], quota)
            os.replace(tmp, path)
            return datasets_db.create_dataset(s, principal.tenant_id, dataset_id, filename, report)
    except BaseException:
        path.unlink(missing_ok=True)  # not recorded: not stored
        raise


def _store(
    services: Services,
    principal: Principal,
    tmp: Path,
    filename: str,
    _fields: dict[str, str],
    report: dict[str, Any],
) -> JSONResponse:
    ds = store_dataset(services, principal, tmp, filename, report)
    dataset_id = ds.id
    body = dataset_out(ds).model_dump(mode="json")
    if report["valid"]:
        return JSONResponse(body, 201, headers={"Location": f"/datasets/{dataset_id}"})
    first = report["problems"][0] if report["problems"] else None
    where = first["message"] if first else "the file has problems"
    message = f"dataset {dataset_id} is invalid ({where}); it is stored with status 'invalid'"
    return JSONResponse(error_body("invalid_dataset", message, "file", body), 422)


@router.get("", response_model=Page[DatasetOut])
def list_datasets(
    session: SessionDep,
    principal: PrincipalDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    after: Annotated[str | None, Query(max_length=200)] = None,
) -> Page[DatasetOut]:
    rows, cursor = datasets_db.list_datasets(session, limit, after, scope(principal))
    return Page[DatasetOut](
        data=[dataset_out(d) for d in rows], has_more=cursor is not None, next_cursor=cursor
    )


@router.get("/{dataset_id}", response_model=DatasetOut, responses=errors(404))
def get_dataset(dataset_id: str, session: SessionDep, principal: PrincipalDep) -> DatasetOut:
    ds = datasets_db.get_dataset(session, dataset_id, scope(principal))
    if ds is None:
        raise NotFound(f"dataset {dataset_id!r} not found", code="dataset_not_found", param="dataset_id")
    return dataset_out(ds)


@router.delete("/{dataset_id}", status_code=204, responses=errors(404, 409))
def delete_dataset(dataset_id: str, services: ServicesDep, principal: PrincipalDep) -> None:
    """Delete a dataset and its stored file; refused (409 dataset_in_use) while a job that has not finished
    trains or validates on it. Finished jobs that used it keep its record, marked deleted."""
    with session_scope(services.sessions) as s:
        tenants_db.lock_tenant(s, principal.tenant_id)  # one at a time with job inserts that name it
        ds = datasets_db.get_live_dataset(s, dataset_id, principal.tenant_id)
        if ds is None:
            raise NotFound(f"dataset {dataset_id!r} not found", code="dataset_not_found", param="dataset_id")
        blocking = datasets_db.delete_unless_in_use(s, ds)
        if blocking:
            raise Conflict(
                f"dataset {dataset_id} is used by {len(blocking)} job(s) that have not finished; cancel them "
                "or wait for them to finish",
                code="dataset_in_use",
                param="dataset_id",
                details={"jobs": blocking},
            )
    services.storage.dataset_path(dataset_id).unlink(missing_ok=True)
