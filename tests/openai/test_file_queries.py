"""The queries /v1/files stands on, on every database the suite reaches (SQLite, and PostgreSQL when
it runs): which unfinished jobs use a dataset (as training or validation data), deletion, and paging
by file id."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session

from core.errors import InvalidInput
from models import datasets as datasets_db
from models.db import make_engine, make_session_factory, session_scope
from models.tables import Dataset, Job
from models.tenants import get_or_create_tenant

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def session(migrated_url: str) -> Iterator[Session]:
    engine = make_engine(migrated_url)
    try:
        with session_scope(make_session_factory(engine)) as s:
            yield s
    finally:
        engine.dispose()


def dataset(s: Session, tenant_id: str, n: int, at: datetime | None = None) -> Dataset:
    ds = Dataset(
        id=f"{n:032x}",
        tenant_id=tenant_id,
        filename=f"{n}.jsonl",
        status="valid",
        format="instruction",
        num_examples=5,
        size_bytes=100,
        sha256="0" * 64,
        report={},
        created_at=at or T0 + timedelta(seconds=n),
    )
    s.add(ds)
    s.flush()
    return ds


def job(s: Session, tenant_id: str, n: int, status: str, train: str, validation: str | None = None) -> str:
    job_id = f"{n:031x}j"
    spec = {"base_model": "tiny", "dataset_id": train, "validation_dataset_id": validation}
    s.add(
        Job(
            id=job_id,
            tenant_id=tenant_id,
            status=status,
            spec=spec,
            dataset_id=train,
            base_model="tiny",
            method="lora",
            created_at=T0 + timedelta(seconds=n),
        )
    )
    s.flush()
    return job_id


def test_unfinished_jobs_block_deletion_by_training_or_validation_data(session: Session) -> None:
    acme = get_or_create_tenant(session, "acme").id
    train, val, done, unused = (dataset(session, acme, n) for n in range(1, 5))
    queued = job(session, acme, 1, "queued", train.id)
    running = job(session, acme, 2, "running", train.id, validation=val.id)
    job(session, acme, 3, "succeeded", done.id, validation=train.id)
    job(session, acme, 4, "cancelled", done.id)

    assert datasets_db.unfinished_jobs_using(session, train.id) == [queued, running]
    assert datasets_db.unfinished_jobs_using(session, val.id) == [running]
    assert datasets_db.unfinished_jobs_using(session, done.id) == []
    assert datasets_db.delete_unless_in_use(session, train) == [queued, running]
    assert datasets_db.delete_unless_in_use(session, val) == [running]
    assert {d.status for d in (train, val)} == {"valid"}

    # Finished jobs name it: the row stays, marked deleted, with nothing stored.
    assert datasets_db.delete_unless_in_use(session, done) == []
    session.expire_all()
    row = session.get(Dataset, done.id)
    assert row is not None and (row.status, row.size_bytes) == ("deleted", 0)
    assert datasets_db.get_live_dataset(session, done.id, acme) is None
    # Nothing names it: the row goes.
    unused_id = unused.id
    assert datasets_db.delete_unless_in_use(session, unused) == []
    assert session.get(Dataset, unused_id) is None


def test_list_page_by_file_id(session: Session) -> None:
    acme = get_or_create_tenant(session, "acme").id
    other = get_or_create_tenant(session, "globex").id
    ids = [dataset(session, acme, n).id for n in range(1, 6)]
    dataset(session, other, 9)
    tie = dataset(session, acme, 10, at=T0 + timedelta(seconds=5)).id  # same created_at as ids[-1]
    ids.append(tie)  # (created_at, id) order: the larger id comes later
    deleted = dataset(session, acme, 11)
    deleted.status = datasets_db.DELETED
    session.flush()

    def walk(ascending: bool) -> list[str]:
        seen: list[str] = []
        after, more = None, True
        while more:
            rows, more = datasets_db.list_page(session, acme, limit=2, after_id=after, ascending=ascending)
            seen += [r.id for r in rows]
            after = rows[-1].id if rows else None
        return seen

    assert walk(ascending=True) == ids
    assert walk(ascending=False) == ids[::-1]
    # A deleted file still marks a place to list from; an unknown one or another tenant's does not.
    assert datasets_db.list_page(session, acme, limit=10, after_id=deleted.id)[0][0].id == ids[-1]
    for bad in ("f" * 32, f"{9:032x}", "../x"):
        with pytest.raises(InvalidInput) as e:
            datasets_db.list_page(session, acme, limit=2, after_id=bad)
        assert e.value.param == "after"
