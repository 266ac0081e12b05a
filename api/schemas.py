"""Response shapes. Built from ORM rows by small functions, so the JSON is explicit."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, Field

from core.data.token_stats import TokenStats
from core.spec import JobSpec
from models.tables import Artifact, Dataset, Job, JobEvent


class ErrorInfo(BaseModel):
    code: str
    message: str


class Progress(BaseModel):
    step: int
    total_steps: int | None
    percent: float | None
    epoch: float | None
    loss: float | None
    tokens_per_s: float | None
    eta_seconds: float | None


class QueueInfo(BaseModel):
    """Where a queued job stands (models.queue_view): the fair policy's order on the live workers that
    can run it, and their ETAs."""

    position: int | None = Field(description="1: next on the workers that can run it; null: none alive can.")
    estimated_start: datetime | None = Field(
        description="From the ETAs of the jobs ahead on those workers; null when unknown."
    )
    waiting_reason: str | None = Field(
        description="Why it cannot start now: no live worker can run it (e.g. too little memory), or a "
        "multi-node job has too few workers with room at once (how many have room, what is missing)."
    )


class JobOut(BaseModel):
    id: str
    tenant_id: str
    status: str
    spec: JobSpec
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempt: int
    max_attempts: int
    worker_id: str | None
    cancel_requested: bool
    error: ErrorInfo | None
    progress: Progress
    peak_mem_bytes: int | None
    predicted_peak_bytes: int | None
    adapter_url: str | None
    token_stats: TokenStats | None = Field(
        description="Tokens per example against the base model's tokenizer: pending at submission, "
        "ready seconds later (or failed with an error); null for jobs older than this field."
    )
    queue: QueueInfo | None = Field(None, description="Set on a queued job read by GET /jobs/{id}.")
    deleted_at: datetime | None = Field(
        None, description="Set by DELETE /jobs/{id}: the job's files are gone, its record stays."
    )


class DatasetOut(BaseModel):
    id: str
    tenant_id: str
    filename: str
    status: str
    format: str | None
    num_examples: int
    size_bytes: int
    sha256: str
    created_at: datetime
    report: dict[str, Any]


class EventOut(BaseModel):
    id: int
    kind: str
    message: str
    data: dict[str, Any] | None
    created_at: datetime


class ArtifactOut(BaseModel):
    id: str
    kind: str
    name: str
    size_bytes: int
    sha256: str
    step: int | None
    created_at: datetime
    loss: float | None = None  # a checkpoint's: the training loss logged at its step
    eval_loss: float | None = None  # and the validation loss, when it was evaluated there
    download_url: str


class ModelOut(BaseModel):
    name: str
    source: str
    architecture: str
    model_type: str
    revision: str | None = None  # the Hub commit it was pulled at (or its HF cache snapshot); None: by hand
    family: str = ""  # e.g. "Qwen3-MoE", "Llama" (its model_type where ftune does not read the family)
    modality: str = "text"
    total_params: int | None = None  # None: a family the planner cannot read
    active_params: int | None = None  # parameters one token uses: fewer than total for a mixture of experts


T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    data: list[T]
    has_more: bool
    next_cursor: str | None = None


class EventPage(BaseModel):
    data: list[EventOut]
    has_more: bool
    next_after: int | None


def job_out(job: Job, queue: QueueInfo | None = None) -> JobOut:
    percent = None
    if job.total_steps:
        percent = round(100.0 * min(job.step, job.total_steps) / job.total_steps, 1)
    return JobOut(
        id=job.id,
        tenant_id=job.tenant_id,
        status=job.status,
        spec=JobSpec.model_validate(job.spec),
        created_at=job.created_at,
        updated_at=job.updated_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        attempt=job.attempt,
        max_attempts=job.max_attempts,
        worker_id=job.worker_id,
        cancel_requested=job.cancel_requested,
        error=ErrorInfo(code=job.error_code, message=job.error_message or "") if job.error_code else None,
        progress=Progress(
            step=job.step,
            total_steps=job.total_steps,
            percent=percent,
            epoch=job.epoch,
            loss=job.loss,
            tokens_per_s=job.tokens_per_s,
            eta_seconds=job.eta_seconds,
        ),
        peak_mem_bytes=job.peak_mem_bytes,
        predicted_peak_bytes=job.predicted_peak_bytes,
        adapter_url=f"/jobs/{job.id}/adapter" if job.status == "succeeded" and not job.deleted_at else None,
        token_stats=TokenStats.model_validate(job.token_stats) if job.token_stats else None,
        queue=queue,
        deleted_at=job.deleted_at,
    )


def dataset_out(ds: Dataset) -> DatasetOut:
    return DatasetOut(
        id=ds.id,
        tenant_id=ds.tenant_id,
        filename=ds.filename,
        status=ds.status,
        format=ds.format,
        num_examples=ds.num_examples,
        size_bytes=ds.size_bytes,
        sha256=ds.sha256,
        created_at=ds.created_at,
        report=ds.report,
    )


def event_out(ev: JobEvent) -> EventOut:
    return EventOut(id=ev.id, kind=ev.kind, message=ev.message, data=ev.data, created_at=ev.created_at)


def artifact_out(art: Artifact, loss: float | None = None, eval_loss: float | None = None) -> ArtifactOut:
    return ArtifactOut(
        id=art.id,
        kind=art.kind,
        name=art.relpath,
        size_bytes=art.size_bytes,
        sha256=art.sha256,
        step=art.step,
        created_at=art.created_at,
        loss=loss,
        eval_loss=eval_loss,
        download_url=f"/jobs/{art.job_id}/artifacts/{art.id}/download",
    )
