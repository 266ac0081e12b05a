"""jobs.token_stats: the 0002 migration keeps older jobs (NULL), and the two writers never clobber
ready statistics (compare-and-set on the stored status)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.orm import Session, sessionmaker

from core.data.token_stats import failed
from core.spec import JobSpec
from models import datasets as datasets_db
from models import jobs as jobs_db
from models.db import make_engine, make_session_factory, session_scope
from models.migrate import downgrade, upgrade
from models.tenants import get_or_create_tenant

SPEC = JobSpec(base_model="m", dataset_id="ds000001")
REPORT = {"valid": True, "format": "text", "num_examples": 3, "size_bytes": 10, "sha256": "0" * 64}
READY = {"status": "ready", "count": 3, "p50": 5, "p95": 9, "max": 9, "max_seq_len": 8}
READY |= {"over_max_seq_len": 1, "over_length": "truncate", "dropped": 0}


@pytest.fixture
def sessions(migrated_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(migrated_url)
    yield make_session_factory(engine)
    engine.dispose()


def _job(sessions: sessionmaker[Session]) -> str:
    with session_scope(sessions) as s:
        tenant = get_or_create_tenant(s, "t")
        datasets_db.create_dataset(s, tenant.id, "ds000001", "a.jsonl", REPORT)
        jobs_db.create_job(s, tenant.id, "job00000001", SPEC)
    return "job00000001"


def _stats(sessions: sessionmaker[Session], job_id: str) -> dict[str, Any] | None:
    with sessions() as s:
        job = jobs_db.get_job(s, job_id)
        assert job is not None
        return job.token_stats


def _events(sessions: sessionmaker[Session], job_id: str) -> list[str]:
    with sessions() as s:
        rows, _ = jobs_db.list_events(s, job_id, 0, 100)
        return [e.message for e in rows if e.kind == "token_stats"]


def test_created_pending_then_stored_once(sessions: sessionmaker[Session]) -> None:
    job_id = _job(sessions)
    assert _stats(sessions, job_id) == {"status": "pending"}
    with session_scope(sessions) as s:
        assert jobs_db.store_token_stats(s, job_id, {**READY, "source": "job_created"})
    with session_scope(sessions) as s:  # training's start comes later: the first answer stays
        assert not jobs_db.fill_token_stats(s, job_id, {**READY, "count": 99, "source": "training_start"})
        assert not jobs_db.store_token_stats(s, job_id, {**READY, "count": 98})
    stats = _stats(sessions, job_id)
    assert stats is not None and stats["count"] == 3 and stats["source"] == "job_created"
    (msg,) = _events(sessions, job_id)
    assert msg.startswith("warning: token statistics: 3 examples, p50 5 / p95 9 / max 9 tokens")
    assert "1 exceed max_seq_len 8 and will be truncated" in msg


def test_training_fills_failed_and_the_late_api_answer_is_dropped(sessions: sessionmaker[Session]) -> None:
    job_id = _job(sessions)
    with session_scope(sessions) as s:
        assert jobs_db.store_token_stats(s, job_id, failed("timeout", "took too long"))
    with session_scope(sessions) as s:
        assert jobs_db.fill_token_stats(s, job_id, {**READY, "source": "training_start"})
    with session_scope(sessions) as s:
        assert not jobs_db.store_token_stats(s, job_id, READY)  # no longer pending
    stats = _stats(sessions, job_id)
    assert stats is not None and stats["status"] == "ready" and stats["source"] == "training_start"
    assert [m.split(":")[0] for m in _events(sessions, job_id)] == [
        "token statistics failed (timeout)",
        "warning",
    ]


def test_migration_keeps_older_jobs_and_training_fills_them(database_url: str) -> None:
    upgrade(database_url, "0001")
    engine = make_engine(database_url)
    try:
        sessions = make_session_factory(engine)
        with engine.begin() as conn:  # a job written by the 0001 schema
            conn.execute(text("INSERT INTO tenants (id, name, created_at) VALUES ('t1', 't', :now)"), _now())
            conn.execute(
                text(
                    "INSERT INTO datasets (id, tenant_id, filename, status, num_examples, size_bytes, sha256,"
                    " report, created_at) VALUES ('ds000001', 't1', 'a', 'valid', 3, 10, 'x', '{}', :now)"
                ),
                _now(),
            )
            conn.execute(
                text(
                    "INSERT INTO jobs (id, tenant_id, status, spec, dataset_id, base_model, method,"
                    " created_at, updated_at, attempt, max_attempts, cancel_requested, step) VALUES"
                    " ('job00000001', 't1', 'running', '{}', 'ds000001', 'm', 'lora', :now, :now, 1, 3,"
                    " false, 0)"
                ),
                _now(),
            )
        upgrade(database_url)
        assert _stats(sessions, "job00000001") is None
        with session_scope(sessions) as s:
            assert jobs_db.fill_token_stats(s, "job00000001", READY)
        assert (_stats(sessions, "job00000001") or {})["status"] == "ready"
        downgrade(database_url, "0001")
        engine.dispose()
        assert "token_stats" not in {c["name"] for c in inspect(engine).get_columns("jobs")}
    finally:
        engine.dispose()
        upgrade(database_url)


def _now() -> dict[str, Any]:
    from models.tables import utcnow

    return {"now": utcnow()}
