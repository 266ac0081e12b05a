"""Queries behind /v1/fine_tuning/jobs: a tenant's jobs paged by job id with metadata filters, and the
checkpoints a job keeps. Every query is scoped to one tenant (the organization)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from core.errors import InvalidInput
from models.jobs import get_job
from models.tables import Artifact, Job


def list_page(
    session: Session,
    tenant_id: str,
    *,
    limit: int,
    after_id: str | None = None,
    metadata: dict[str, str] | None = None,
) -> tuple[list[Job], bool]:
    """A page of the tenant's jobs, newest first by (created_at, id), past the job `after_id` (OpenAI's
    `after`), with every metadata pair matching; and whether more follow."""
    stmt = select(Job).where(Job.tenant_id == tenant_id)
    for key, value in (metadata or {}).items():
        stmt = stmt.where(Job.user_metadata[key].as_string() == value)
    if after_id is not None:
        anchor = get_job(session, after_id, tenant_id)
        if anchor is None:
            raise InvalidInput(f"no job {after_id!r} to list after", code="invalid_cursor", param="after")
        at, id_ = anchor.created_at, anchor.id
        stmt = stmt.where(or_(Job.created_at < at, and_(Job.created_at == at, Job.id < id_)))
    stmt = stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)
    rows = list(session.scalars(stmt))
    return rows[:limit], len(rows) > limit


def checkpoints(session: Session, job_id: str) -> list[Artifact]:
    """The job's checkpoints in step order (the latest row per step: a resumed run may save a step again)."""
    rows = session.scalars(
        select(Artifact)
        .where(Artifact.job_id == job_id, Artifact.kind == "checkpoint")
        .order_by(Artifact.step, Artifact.created_at)
    )
    by_step = {a.step: a for a in rows}
    return list(by_step.values())


def checkpoint(session: Session, job_id: str, step: int) -> Artifact | None:
    """The job's checkpoint at `step` (its latest row), or None. Its directory may have been pruned since
    (spec.keep_checkpoints): callers with the storage check it is still on disk."""
    return session.scalars(
        select(Artifact)
        .where(Artifact.job_id == job_id, Artifact.kind == "checkpoint", Artifact.step == step)
        .order_by(Artifact.created_at.desc())
        .limit(1)
    ).first()


def is_stored(art: Artifact, job_dir: Path) -> bool:
    """Whether an artifact's files are still on disk (keep_checkpoints prunes older checkpoints). relpath
    was written by the worker from known names; checked to stay under the job's directory anyway."""
    path = job_dir / art.relpath
    return path.resolve().is_relative_to(job_dir.resolve()) and path.exists()


def stored_checkpoints(session: Session, job_id: str, job_dir: Path) -> list[Artifact]:
    """The job's checkpoints still on disk, in step order (the latest row per step)."""
    return [a for a in checkpoints(session, job_id) if is_stored(a, job_dir)]
