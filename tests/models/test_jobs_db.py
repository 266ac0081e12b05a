"""Job state changes are compare-and-set: duplicates, stale workers and finished jobs cannot win."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy.orm import Session, sessionmaker

from core.spec import JobSpec
from core.states import JobStatus
from models import datasets as datasets_db
from models import jobs as jobs_db
from models.db import make_engine, make_session_factory, session_scope
from models.tables import utcnow
from models.tenants import get_or_create_tenant

SPEC = JobSpec(base_model="m", dataset_id="ds000001")
REPORT = {"valid": True, "format": "instruction", "num_examples": 3, "size_bytes": 10, "sha256": "0" * 64}


@pytest.fixture
def sessions(migrated_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(migrated_url)
    yield make_session_factory(engine)
    engine.dispose()


def _new_job(sessions: sessionmaker[Session], job_id: str = "job00000001") -> str:
    with session_scope(sessions) as s:
        tenant = get_or_create_tenant(s, "t")
        datasets_db.create_dataset(s, tenant.id, "ds000001", "a.jsonl", REPORT)
        jobs_db.create_job(s, tenant.id, job_id, SPEC)
    return job_id


def _tenant(sessions: sessionmaker[Session]) -> str:
    with session_scope(sessions) as s:
        return get_or_create_tenant(s, "t").id


def test_claim_is_compare_and_set(sessions: sessionmaker[Session]) -> None:
    job_id = _new_job(sessions)
    with session_scope(sessions) as s:
        assert jobs_db.claim(s, job_id=job_id, worker_id="w1", lease_seconds=60) == 1
    with session_scope(sessions) as s:
        assert (
            jobs_db.claim(s, job_id=job_id, worker_id="w2", lease_seconds=60) is None
        )  # a redelivered message does nothing
        job = jobs_db.get_job(s, job_id)
        assert job is not None and job.status == JobStatus.RUNNING and job.worker_id == "w1"


def test_stale_attempt_cannot_write(sessions: sessionmaker[Session]) -> None:
    job_id = _new_job(sessions)
    with session_scope(sessions) as s:
        assert jobs_db.claim(s, job_id=job_id, worker_id="w1", lease_seconds=60) == 1
        assert jobs_db.finish(s, job_id=job_id, attempt=1, dst=JobStatus.QUEUED, message="worker lost; retry")
    with session_scope(sessions) as s:
        assert jobs_db.claim(s, job_id=job_id, worker_id="w2", lease_seconds=60) == 2
    with session_scope(sessions) as s:
        assert not jobs_db.heartbeat(
            s, job_id=job_id, attempt=1, lease_seconds=60, step=5
        )  # attempt 1 is fenced off
        assert not jobs_db.finish(s, job_id=job_id, attempt=1, dst=JobStatus.SUCCEEDED, message="stale")
        assert jobs_db.heartbeat(s, job_id=job_id, attempt=2, lease_seconds=60, step=7, loss=1.5)
    with session_scope(sessions) as s:
        job = jobs_db.get_job(s, job_id)
        assert job is not None and job.status == JobStatus.RUNNING and job.step == 7 and job.attempt == 2


def test_cancel_queued_running_and_finished(sessions: sessionmaker[Session]) -> None:
    a, b = _new_job(sessions, "joba0000001"), "jobb0000001"
    with session_scope(sessions) as s:
        jobs_db.create_job(s, _tenant(sessions), b, SPEC)
    with session_scope(sessions) as s:
        assert jobs_db.request_cancel(s, job_id=a) == "cancelled"
        assert (
            jobs_db.claim(s, job_id=a, worker_id="w1", lease_seconds=60) is None
        )  # a cancelled job is never started
        assert jobs_db.claim(s, job_id=b, worker_id="w1", lease_seconds=60) == 1
        assert jobs_db.request_cancel(s, job_id=b) == "cancelling"
        assert jobs_db.cancel_requested(s, job_id=b)
        assert jobs_db.finish(s, job_id=b, attempt=1, dst=JobStatus.CANCELLED, message="cancelled")
        assert jobs_db.request_cancel(s, job_id=b) == "finished"
    with sessions() as s:
        kinds = [e.kind for e in jobs_db.list_events(s, b, 0, 100)[0]]
    assert kinds == ["queued", "started", "cancel_requested", "cancelled"]


def test_expired_lease_is_found(sessions: sessionmaker[Session]) -> None:
    job_id = _new_job(sessions)
    with session_scope(sessions) as s:
        jobs_db.claim(s, job_id=job_id, worker_id="w1", lease_seconds=0.01)
    with sessions() as s:
        assert [j.id for j in jobs_db.expired_leases(s, now=utcnow() + timedelta(seconds=1))] == [job_id]
        assert jobs_db.expired_leases(s, now=utcnow() - timedelta(seconds=10)) == []


def test_list_jobs_paginates_newest_first(sessions: sessionmaker[Session]) -> None:
    _new_job(sessions, "job00000000")
    with session_scope(sessions) as s:
        for i in range(1, 5):
            jobs_db.create_job(s, _tenant(sessions), f"job0000000{i}", SPEC)
    seen, cursor = [], None
    with sessions() as s:
        while True:
            rows, cursor = jobs_db.list_jobs(s, 2, cursor)
            seen += [r.id for r in rows]
            if cursor is None:
                break
    assert sorted(seen) == [f"job0000000{i}" for i in range(5)] and len(seen) == 5
