"""OpenAI's fine-tuning job object, built from ftune's Job rows (a /v1 job is a job, under the same id).

Native jobs show here too: their hyperparameters are resolved from their JobSpec alike.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from api.openai.hyperparameters import resolved
from core import ft_names
from core.data.token_stats import PENDING
from core.run_protocol import StepRecord, read_records
from core.spec import JobSpec
from core.states import JobStatus
from core.storage import Storage
from models.tables import Job

OpenAIStatus = Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled", "paused"]
RESULT_FILE_PREFIX = "file-results-"


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class FineTuningJob(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    finished_at: int | None
    estimated_finish: int | None
    model: str
    fine_tuned_model: str | None
    organization_id: str
    status: OpenAIStatus
    error: JobError | None
    hyperparameters: dict[str, Any]
    method: dict[str, Any]
    training_file: str
    validation_file: str | None
    trained_tokens: int | None
    seed: int
    metadata: dict[str, str] | None
    result_files: list[str]
    integrations: list[dict[str, Any]] | None = None
    user_provided_suffix: str | None = None


class FineTuningJobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJob]
    has_more: bool


def result_file_id(job_id: str) -> str:
    return f"{RESULT_FILE_PREFIX}{job_id}"


def result_file_job(file_id: str) -> str | None:
    """The job whose result file this id names, or None if it names no result file."""
    return file_id[len(RESULT_FILE_PREFIX) :] if file_id.startswith(RESULT_FILE_PREFIX) else None


def openai_status(job: Job) -> OpenAIStatus:
    status = JobStatus(job.status)
    if status == JobStatus.QUEUED:
        # ftune validates the file at upload; what a queued job still waits for before it can run is its
        # token statistics against the base model's tokenizer (a CPU worker computes them).
        return "validating_files" if job.token_stats == PENDING else "queued"
    if status == JobStatus.PAUSING:
        return "running"  # it checkpoints after its current step, then shows paused
    return status.value  # type: ignore[return-value]


def fine_tuned_model(job: Job) -> str:
    return ft_names.fine_tuned_model(job.base_model, job.tenant_id, job.suffix, job.id)


def trained_tokens(job: Job, storage: Storage) -> int | None:
    """Input tokens trained on, summed over the steps that count after every resume; set on success."""
    if job.status != JobStatus.SUCCEEDED:
        return None
    return sum(r.tokens for r in read_records(storage.metrics_path(job.id)) if isinstance(r, StepRecord))


def _unix(value: Any) -> int | None:
    return int(value.timestamp()) if value is not None else None


def job_object(job: Job, storage: Storage) -> FineTuningJob:
    spec = JobSpec.model_validate(job.spec)
    method = (job.openai or {}).get("method", {})
    method_type = method.get("type", "supervised")
    asked = method.get(method_type) or {}  # reinforcement: what the spec does not hold, as it was asked
    echo = {
        "reasoning_effort": asked.get("hyperparameters", {}).get("reasoning_effort", "auto"),
        "response_format": asked.get("response_format"),
    }
    shown = resolved(spec, method_type, echo)
    succeeded = job.status == JobStatus.SUCCEEDED
    eta = None
    if job.status in (JobStatus.RUNNING, JobStatus.PAUSING) and job.eta_seconds is not None:
        eta = int(job.updated_at.timestamp() + job.eta_seconds)
    error = None
    if job.status == JobStatus.FAILED:
        error = JobError(code=job.error_code or "failed", message=job.error_message or "the job failed")
    return FineTuningJob(
        id=job.id,
        created_at=int(job.created_at.timestamp()),
        finished_at=_unix(job.finished_at),
        estimated_finish=eta,
        model=(job.openai or {}).get("model", job.base_model),
        fine_tuned_model=fine_tuned_model(job) if succeeded else None,
        organization_id=job.tenant_id,
        status=openai_status(job),
        error=error,
        hyperparameters=shown["hyperparameters"],
        method=shown["method"],
        training_file=job.dataset_id,
        validation_file=spec.validation_dataset_id,
        trained_tokens=trained_tokens(job, storage),
        seed=spec.seed,
        metadata=job.user_metadata,
        result_files=[result_file_id(job.id)] if succeeded else [],
        user_provided_suffix=job.suffix,
    )
