"""Queries on datasets."""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, and_, or_, select
from sqlalchemy.orm import Session

from core.errors import InvalidInput
from core.spec import ID_RE
from core.states import TERMINAL
from models.pagination import newest_first, page
from models.tables import Dataset, Job

# Deleted by its owner while finished jobs still name it: the row stays so their records are whole,
# the stored file is gone.
DELETED = "deleted"


def create_dataset(
    session: Session, tenant_id: str, dataset_id: str, filename: str, report: dict[str, Any]
) -> Dataset:
    ds = Dataset(
        id=dataset_id,
        tenant_id=tenant_id,
        filename=filename,
        status="valid" if report["valid"] else "invalid",
        format=report.get("format"),
        num_examples=report["num_examples"],
        size_bytes=report["size_bytes"],
        sha256=report["sha256"],
        report=report,
    )
    session.add(ds)
    session.flush()
    return ds


def get_dataset(session: Session, dataset_id: str, tenant_id: str | None = None) -> Dataset | None:
    """The dataset, if it exists and (when tenant_id is given) belongs to that tenant."""
    if not ID_RE.match(dataset_id):  # e.g. "../x" or a NUL byte, which PostgreSQL refuses with an error
        return None
    ds = session.get(Dataset, dataset_id)
    return ds if ds is not None and tenant_id in (None, ds.tenant_id) else None


def list_datasets(
    session: Session, limit: int, after: str | None, tenant_id: str | None = None
) -> tuple[list[Dataset], str | None]:
    stmt = select(Dataset).where(Dataset.status != DELETED)
    if tenant_id is not None:
        stmt = stmt.where(Dataset.tenant_id == tenant_id)
    rows = session.scalars(newest_first(stmt, Dataset, after, limit)).all()
    return page(list(rows), limit)


def get_live_dataset(session: Session, dataset_id: str, tenant_id: str) -> Dataset | None:
    """The tenant's dataset, unless it was deleted."""
    ds = get_dataset(session, dataset_id, tenant_id)
    return ds if ds is not None and ds.status != DELETED else None


def list_page(
    session: Session, tenant_id: str, *, limit: int, after_id: str | None = None, ascending: bool = False
) -> tuple[list[Dataset], bool]:
    """A page of the tenant's datasets that are not deleted, by (created_at, id), and whether more follow.

    `after_id` is a dataset id (OpenAI's `after`): the page starts past it in the chosen order.
    """
    stmt = select(Dataset).where(Dataset.tenant_id == tenant_id, Dataset.status != DELETED)
    if after_id is not None:
        anchor = get_dataset(session, after_id, tenant_id)
        if anchor is None:
            raise InvalidInput(f"no file {after_id!r} to list after", code="invalid_cursor", param="after")
        at, id_ = anchor.created_at, anchor.id
        if ascending:
            stmt = stmt.where(or_(Dataset.created_at > at, and_(Dataset.created_at == at, Dataset.id > id_)))
        else:
            stmt = stmt.where(or_(Dataset.created_at < at, and_(Dataset.created_at == at, Dataset.id < id_)))
    if ascending:
        stmt = stmt.order_by(Dataset.created_at.asc(), Dataset.id.asc())
    else:
        stmt = stmt.order_by(Dataset.created_at.desc(), Dataset.id.desc())
    rows = list(session.scalars(stmt.limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def _used_by(dataset_id: str) -> ColumnElement[bool]:
    """Jobs that train on the dataset or validate on it."""
    return or_(Job.dataset_id == dataset_id, Job.spec["validation_dataset_id"].as_string() == dataset_id)


def unfinished_jobs_using(session: Session, dataset_id: str) -> list[str]:
    """Ids of the jobs not finished (any status but the terminal ones) that use the dataset, oldest first."""
    finished = [status.value for status in TERMINAL]
    stmt = select(Job.id).where(_used_by(dataset_id), Job.status.not_in(finished)).order_by(Job.created_at)
    return list(session.scalars(stmt))


def delete_unless_in_use(session: Session, ds: Dataset) -> list[str]:
    """Delete the dataset's row unless unfinished jobs use it; return their ids (empty: deleted).

    When finished jobs still name it, the row stays, marked DELETED with size_bytes 0 (nothing is
    stored any more, so the tenant's storage quota gets its bytes back; the report keeps the size).
    The caller removes the stored file after the commit.
    """
    blocking = unfinished_jobs_using(session, ds.id)
    if blocking:
        return blocking
    if session.scalar(select(Job.id).where(_used_by(ds.id)).limit(1)) is None:
        session.delete(ds)
    else:
        ds.status = DELETED
        ds.size_bytes = 0
    session.flush()
    return []
