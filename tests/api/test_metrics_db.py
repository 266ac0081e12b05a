"""/metrics job numbers on a real database: the same values as computed job by job, from queries whose
results stay a few rows however many jobs have ever run."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, event
from sqlalchemy.orm import Session, sessionmaker

from api.metrics import JOB_BUCKETS, ServiceCollector
from core.states import TERMINAL, JobStatus
from models import datasets as datasets_db
from models.db import make_engine, make_session_factory, session_scope
from models.tables import Job, utcnow
from models.tenants import get_or_create_tenant

REPORT = {"valid": True, "format": "instruction", "num_examples": 3, "size_bytes": 10, "sha256": "0" * 64}
# Seconds from start to finish: on bucket bounds, between them, past the last, sub-second parts, and a
# finish recorded before the start (clock skew between workers), which counts as 0.
DURATIONS = [30.0, 60.0, 61.5, 299.999999, 300.000001, 4000.25, 100000.0, 0.0, -5.0, 86400.0]
HISTORY = 40  # finished jobs: more rows than any per-scrape query may return


@pytest.fixture
def engine(migrated_url: str) -> Iterator[Engine]:
    engine = make_engine(migrated_url)
    yield engine
    engine.dispose()


def _jobs(sessions: sessionmaker[Session]) -> list[Job]:
    base = utcnow() - timedelta(days=30)
    finished = [JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED]
    with session_scope(sessions) as s:
        tenant = get_or_create_tenant(s, "t").id
        datasets_db.create_dataset(s, tenant, "ds000001", "a.jsonl", REPORT)
        when = [base + timedelta(hours=i) for i in range(HISTORY)]
        jobs = [
            _job(tenant, f"done{i:04d}", finished[i % 3], when[i], DURATIONS[i % len(DURATIONS)])
            for i in range(HISTORY)
        ]
        jobs += [
            _job(tenant, "cancelledq", JobStatus.CANCELLED, None, None),  # never ran: no duration
            _job(tenant, "queued0001", JobStatus.QUEUED, None, None),
            _job(tenant, "queued0002", JobStatus.QUEUED, None, None),
            _job(tenant, "running001", JobStatus.RUNNING, base, None, tokens_per_s=1234.5, worker_id="w1"),
            _job(tenant, "running002", JobStatus.RUNNING, base, None),  # no step reported yet
        ]
        s.add_all(jobs)
    return jobs


def _job(tenant: str, id_: str, status: str, started: Any, seconds: float | None, **kw: Any) -> Job:
    end = None if seconds is None else started + timedelta(seconds=seconds)
    return Job(
        id=id_, tenant_id=tenant, status=str(status), spec={}, dataset_id="ds000001", base_model="m",
        method="lora", started_at=started, finished_at=end, **kw,
    )  # fmt: skip


def _expected(jobs: list[Job]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The job numbers computed one job at a time, as the first /metrics did."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for status in JobStatus:
        out["ftune_jobs", (("status", str(status)),)] = sum(1 for j in jobs if j.status == status)
    out["ftune_queue_depth", ()] = sum(1 for j in jobs if j.status == JobStatus.QUEUED)
    ran = [j for j in jobs if j.status in TERMINAL and j.started_at and j.finished_at]
    for status in {j.status for j in ran}:
        values = [max(0.0, (j.finished_at - j.started_at).total_seconds()) for j in ran if j.status == status]  # type: ignore[operator]
        for b in JOB_BUCKETS:
            le = (("le", str(b)), ("status", status))
            out["ftune_job_duration_seconds_bucket", le] = sum(1 for v in values if v <= b)
        out["ftune_job_duration_seconds_bucket", (("le", "+Inf"), ("status", status))] = len(values)
        out["ftune_job_duration_seconds_count", (("status", status),)] = len(values)
        out["ftune_job_duration_seconds_sum", (("status", status),)] = sum(values)
    out["ftune_job_tokens_per_second", (("job_id", "running001"), ("worker", "w1"))] = 1234.5
    out["ftune_training_tokens_per_second", ()] = 1234.5
    out["ftune_workers", (("state", "alive"),)] = 0
    out["ftune_workers", (("state", "lost"),)] = 0
    return out


def _scraped(sessions: sessionmaker[Session]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = [s for metric in ServiceCollector(sessions).collect() for s in metric.samples]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}


def test_metrics_equal_the_per_job_numbers(engine: Engine) -> None:
    sessions = make_session_factory(engine)
    jobs = _jobs(sessions)
    expected, scraped = _expected(jobs), _scraped(sessions)
    assert scraped.keys() == expected.keys()
    for name, want in expected.items():
        assert scraped[name] == pytest.approx(want, rel=1e-12, abs=1e-6), name


def test_a_scrape_fetches_a_few_rows_whatever_the_history(engine: Engine) -> None:
    sessions = make_session_factory(engine)
    _jobs(sessions)
    statements: list[tuple[str, Any]] = []

    @event.listens_for(engine, "before_cursor_execute")
    def _record(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        statements.append((statement, parameters))

    _scraped(sessions)
    event.remove(engine, "before_cursor_execute", _record)
    on_jobs = [(sql, params) for sql, params in statements if "FROM jobs" in sql]
    assert on_jobs, statements
    with engine.connect() as conn:  # the same statements again, counting the rows each one returns
        fetched = {" ".join(sql.split()): len(conn.exec_driver_sql(sql, p).all()) for sql, p in on_jobs}
    assert all(n <= len(JobStatus) for n in fetched.values()), fetched
