"""The queries /v1/fine_tuning/jobs and webhooks stand on, on every database the suite reaches (SQLite, and
PostgreSQL when it runs): paging by job id with metadata filters, the webhook outbox written by a job's
terminal transition and its delivery claims, and deleting a finished job."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session

from core.errors import InvalidInput
from core.states import JobStatus
from models import jobs as jobs_db
from models import openai_jobs
from models import webhooks as webhooks_db
from models.db import make_engine, make_session_factory, session_scope
from models.tables import Artifact, Job, WebhookEvent, utcnow
from models.tenants import get_or_create_tenant
from models.transitions import transition
from tests.rows import valid_dataset

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def session(migrated_url: str) -> Iterator[Session]:
    engine = make_engine(migrated_url)
    try:
        with session_scope(make_session_factory(engine)) as s:
            yield s
    finally:
        engine.dispose()


def job(
    s: Session, tenant_id: str, n: int, metadata: dict[str, str] | None = None, at: datetime | None = None
) -> str:
    ds_id = f"{n:031x}d"
    s.add(valid_dataset(tenant_id, ds_id))
    job_id = f"{n:031x}j"
    s.add(
        Job(
            id=job_id,
            tenant_id=tenant_id,
            status="queued",
            spec={"base_model": "tiny", "dataset_id": ds_id},
            dataset_id=ds_id,
            base_model="tiny",
            method="lora",
            created_at=at or T0 + timedelta(seconds=n),
            user_metadata=metadata,
        )
    )
    s.flush()
    return job_id


def test_pages_newest_first_by_job_id_with_metadata_filters(session: Session) -> None:
    acme = get_or_create_tenant(session, "acme").id
    other = get_or_create_tenant(session, "other").id
    ids = [job(session, acme, n, {"team": "a" if n % 2 else "b", "n": str(n)}) for n in range(1, 6)]
    tie = [job(session, acme, n, at=T0 + timedelta(seconds=9)) for n in (20, 21)]  # same created_at
    job(session, other, 30, {"team": "a"})

    walked, after = [], None
    while True:
        rows, more = openai_jobs.list_page(session, acme, limit=2, after_id=after)
        walked += [j.id for j in rows]
        if not more:
            break
        after = rows[-1].id
    assert walked == [tie[1], tie[0], *ids[::-1]]
    rows, more = openai_jobs.list_page(session, acme, limit=10, metadata={"team": "a"})
    assert [j.id for j in rows] == [ids[4], ids[2], ids[0]] and not more
    rows, _ = openai_jobs.list_page(session, acme, limit=10, metadata={"team": "a", "n": "3"})
    assert [j.id for j in rows] == [ids[2]]
    assert openai_jobs.list_page(session, acme, limit=10, metadata={"team": "c"}) == ([], False)
    with pytest.raises(InvalidInput):  # another tenant's job is no place to list from
        openai_jobs.list_page(session, other, limit=2, after_id=ids[0])


def test_a_terminal_transition_writes_one_outbox_row_per_endpoint_and_claims_are_exclusive(
    session: Session,
) -> None:
    acme = get_or_create_tenant(session, "acme").id
    quiet = get_or_create_tenant(session, "quiet").id
    hooks = [webhooks_db.register(session, tenant_id=acme, url=f"http://h/{i}") for i in range(2)]
    assert all(h.secret.startswith("whsec_") for h in hooks)
    done, silent = job(session, acme, 1), job(session, quiet, 2)
    assert transition(session, job_id=done, src=JobStatus.QUEUED, dst=JobStatus.RUNNING)
    assert session.query(WebhookEvent).count() == 0  # not terminal: no event
    assert transition(session, job_id=done, src=JobStatus.RUNNING, dst=JobStatus.SUCCEEDED)
    assert transition(session, job_id=silent, src=JobStatus.QUEUED, dst=JobStatus.CANCELLED)
    events = session.query(WebhookEvent).all()
    assert sorted(e.webhook_id for e in events) == sorted(h.id for h in hooks)  # the quiet tenant has none
    assert {(e.type, e.payload["data"]["id"]) for e in events} == {("fine_tuning.job.succeeded", done)}

    now = utcnow() + timedelta(seconds=1)
    due = webhooks_db.due(session, now=now)
    assert sorted(d[0] for d in due) == sorted(e.id for e in events) and {d[1] for d in due} == {0}
    first = events[0].id
    assert webhooks_db.claim(session, event_id=first, attempts=0, now=now, lease_seconds=60)
    assert not webhooks_db.claim(session, event_id=first, attempts=0, now=now, lease_seconds=60)  # taken
    assert first not in [d[0] for d in webhooks_db.due(session, now=now)]  # leased while in flight
    retry = now + timedelta(seconds=5)
    webhooks_db.record_attempt(
        session, event_id=first, attempt=1, started_at=now, status_code=503, error=None, retry_at=retry
    )
    assert first in [d[0] for d in webhooks_db.due(session, now=retry)]
    assert webhooks_db.claim(session, event_id=first, attempts=1, now=retry, lease_seconds=60)
    webhooks_db.record_attempt(
        session, event_id=first, attempt=2, started_at=retry, status_code=204, error=None, retry_at=None
    )
    later = retry + timedelta(days=1)
    assert first not in [d[0] for d in webhooks_db.due(session, now=later)]  # delivered: never again
    assert [(d.attempt, d.status_code) for d in webhooks_db.deliveries(session, first)] == [
        (1, 503),
        (2, 204),
    ]


def test_deleting_a_job_needs_it_finished_and_keeps_its_row(session: Session) -> None:
    acme = get_or_create_tenant(session, "acme").id
    job_id = job(session, acme, 1)
    session.add(
        Artifact(
            id="a" * 32,
            job_id=job_id,
            kind="checkpoint",
            relpath="c/step-1",
            size_bytes=1,
            sha256="0",
            step=1,
        )
    )
    session.flush()
    assert not jobs_db.mark_deleted(session, job_id=job_id)  # queued: not finished
    assert transition(session, job_id=job_id, src=JobStatus.QUEUED, dst=JobStatus.CANCELLED)
    assert jobs_db.mark_deleted(session, job_id=job_id)
    assert jobs_db.mark_deleted(session, job_id=job_id)  # again: the same outcome
    session.expire_all()
    row = session.get(Job, job_id)
    assert row is not None and row.deleted_at is not None and row.status == "cancelled"
    assert session.query(Artifact).filter_by(job_id=job_id).count() == 0
    assert openai_jobs.checkpoints(session, job_id) == []
