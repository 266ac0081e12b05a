"""The fine-tuned models a tenant may call: its succeeded, not deleted jobs, by their `ft:` names, and the
checkpoints those jobs still keep on disk (`ft:...:ckpt-step-<n>`, OpenAI's fine_tuned_model_checkpoint).

One place for /v1/models and /v1/chat/completions to decide what a caller may use. A name is matched
exactly against the job's own `fine_tuned_model` (as OpenAI matches model names), and the job must be the
caller's tenant's: another tenant's model is "not found", exactly like a missing one. A checkpoint pruned by
keep_checkpoints (or deleted with the job) is not found either.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from core import ft_names
from core.states import JobStatus
from core.storage import Storage
from models.jobs import get_job
from models.openai_jobs import checkpoints, is_stored, stored_checkpoints
from models.tables import Artifact, Job


@dataclass(frozen=True)
class FineTunedModel:
    name: str  # ft:<base>:<tenant>:<suffix>:<job id>[:ckpt-step-<n>]
    job_id: str
    base_model: str
    tenant_id: str
    created: datetime
    step: int | None = None  # a checkpoint's model: the step it was saved at
    checkpoint: Path | None = None  # and its directory, on disk when this was made


def _served(job: Job) -> FineTunedModel:
    name = ft_names.fine_tuned_model(job.base_model, job.tenant_id, job.suffix, job.id)
    return FineTunedModel(name, job.id, job.base_model, job.tenant_id, job.finished_at or job.created_at)


def _checkpoint(job: Job, art: Artifact, storage: Storage) -> FineTunedModel:
    final, step = _served(job), art.step or 0
    name = ft_names.checkpoint_model(final.name, step)
    path = storage.job_dir(job.id) / art.relpath
    return FineTunedModel(name, job.id, job.base_model, job.tenant_id, art.created_at, step, path)


def _usable(job: Job | None) -> bool:
    return job is not None and job.status == JobStatus.SUCCEEDED and job.deleted_at is None


def find(session: Session, name: str, tenant_id: str, storage: Storage) -> FineTunedModel | None:
    """The tenant's fine-tuned model of this exact name (a final adapter, or a checkpoint still on disk),
    or None."""
    parsed = ft_names.parse(name)
    job = get_job(session, parsed.job_id, tenant_id) if parsed is not None else None
    if parsed is None or job is None or not _usable(job):
        return None
    if parsed.step is None:
        model = _served(job)
    else:
        art = next((a for a in checkpoints(session, job.id) if a.step == parsed.step), None)
        if art is None or not is_stored(art, storage.job_dir(job.id)):
            return None
        model = _checkpoint(job, art, storage)
    return model if model.name == name else None


def of_tenant(session: Session, tenant_id: str, storage: Storage) -> list[FineTunedModel]:
    """Every model the tenant may call: jobs newest first, each job's final model then its kept checkpoints,
    newest first."""
    stmt = (
        select(Job)
        .where(Job.tenant_id == tenant_id, Job.status == JobStatus.SUCCEEDED, Job.deleted_at.is_(None))
        .order_by(Job.created_at.desc(), Job.id.desc())
    )
    out = []
    for job in list(session.scalars(stmt)):
        out.append(_served(job))
        kept = stored_checkpoints(session, job.id, storage.job_dir(job.id))
        out += [_checkpoint(job, art, storage) for art in reversed(kept)]
    return out
