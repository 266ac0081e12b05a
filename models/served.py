"""The fine-tuned models a tenant may call: its succeeded, not deleted jobs, by their `ft:` names.

One place for /v1/models and /v1/chat/completions to decide what a caller may use. A name is matched
exactly against the job's own `fine_tuned_model` (as OpenAI matches model names), and the job must be the
caller's tenant's: another tenant's model is "not found", exactly like a missing one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from core import ft_names
from core.states import JobStatus
from models.jobs import get_job
from models.tables import Job


@dataclass(frozen=True)
class FineTunedModel:
    name: str  # ft:<base>:<tenant>:<suffix>:<job id>
    job_id: str
    base_model: str
    tenant_id: str
    created: datetime


def _served(job: Job) -> FineTunedModel:
    name = ft_names.fine_tuned_model(job.base_model, job.tenant_id, job.suffix, job.id)
    return FineTunedModel(name, job.id, job.base_model, job.tenant_id, job.finished_at or job.created_at)


def _usable(job: Job | None) -> bool:
    return job is not None and job.status == JobStatus.SUCCEEDED and job.deleted_at is None


def find(session: Session, name: str, tenant_id: str) -> FineTunedModel | None:
    """The tenant's fine-tuned model of this exact name (a final adapter, not a checkpoint), or None."""
    parsed = ft_names.parse(name)
    if parsed is None or parsed.step is not None:
        return None
    job = get_job(session, parsed.job_id, tenant_id)
    if job is None or not _usable(job):
        return None
    model = _served(job)
    return model if model.name == name else None


def of_tenant(session: Session, tenant_id: str) -> list[FineTunedModel]:
    """Every model the tenant may call, newest first."""
    stmt = (
        select(Job)
        .where(Job.tenant_id == tenant_id, Job.status == JobStatus.SUCCEEDED, Job.deleted_at.is_(None))
        .order_by(Job.created_at.desc(), Job.id.desc())
    )
    return [_served(job) for job in session.scalars(stmt)]
