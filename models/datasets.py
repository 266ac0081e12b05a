"""Queries on datasets."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.spec import ID_RE
from models.pagination import newest_first, page
from models.tables import Dataset


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
    stmt = select(Dataset) if tenant_id is None else select(Dataset).where(Dataset.tenant_id == tenant_id)
    rows = session.scalars(newest_first(stmt, Dataset, after, limit)).all()
    return page(list(rows), limit)
