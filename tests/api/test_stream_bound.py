"""Event streams under a hostile tenant, on a real uvicorn server and a real database (issue 41 item 5).

A tenant has at most FTUNE_SSE_MAX_STREAMS_PER_TENANT streams open at once (429 `too_many_streams` with
Retry-After past it, another tenant unaffected), a stream's slot is freed when its client goes, idle
streams cost the database one query a tick in all (api/watch.py) rather than one each, a stream still
gets its job's events and its end at once; and, on `ftune api` in a process of its own, another tenant's
GET /jobs stays fast while the first opens 300 streams (the strict figure: bench/sse_streams.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import event

from api.main import create_app
from core.settings import Settings
from core.states import JobStatus
from models import jobs as jobs_db
from models.db import session_scope
from models.transitions import transition
from tests.api.conftest import RecordingEnqueuer, RecordingTokenStats
from tests.e2e.hostile_load import percentile
from tests.e2e.sse_load import open_streams, probe_jobs, queued_job, sse_stack
from tests.e2e.stack import uvicorn_thread

POLL = 0.1


@contextmanager
def serving(settings: Settings, **values: Any) -> Iterator[tuple[str, FastAPI]]:
    """The app on a real uvicorn server in this process (a thread): its base URL and the app."""
    app = create_app(
        settings.model_copy(update={"sse_poll_seconds": POLL} | values),
        enqueue=RecordingEnqueuer(),
        token_stats=RecordingTokenStats(),
    )
    try:
        with uvicorn_thread(app) as base:
            yield base, app
    finally:
        app.state.services.engine.dispose()


def test_a_tenants_streams_are_bounded_and_a_slot_frees_when_its_client_goes(settings: Settings) -> None:
    with serving(settings, sse_max_streams_per_tenant=3, sse_keepalive_seconds=4.5) as (base, app):
        sessions = app.state.services.sessions
        key_a, job_a = queued_job(sessions, "tenant-a")
        key_b, job_b = queued_job(sessions, "tenant-b")
        a = open_streams(base, key_a, job_a, 5)
        try:
            assert a.statuses == [200, 200, 200, 429, 429]
            head, _, body = a.refusals[0].partition(b"\r\n\r\n")
            assert b"\r\nretry-after: 5\r\n" in head.lower()  # the keep-alive period, rounded up
            assert b'"code":"too_many_streams"' in body
            b = open_streams(base, key_b, job_b, 3)  # another tenant: a bound of its own
            assert b.statuses == [200, 200, 200]
            b.close()
            a.close(1)  # one of A's clients goes: its slot is free at once
            deadline = time.monotonic() + 5
            while (again := open_streams(base, key_a, job_a, 1)).statuses != [200]:
                assert time.monotonic() < deadline, "the closed stream's slot was not freed"
                time.sleep(0.1)
            again.close()
        finally:
            a.close()


def test_idle_streams_share_one_query_a_tick(settings: Settings) -> None:
    """20 idle streams on two jobs for 2 s: about one query a tick (0.1 s) in all, not one a stream."""
    with serving(settings, sse_max_streams_per_tenant=20) as (base, app):
        sessions = app.state.services.sessions
        key, job = queued_job(sessions, "tenant-a")
        _, other = queued_job(sessions, "tenant-a")
        streams = open_streams(base, key, job, 10)
        streams.open += open_streams(base, key, other, 10).open
        try:
            assert len(streams.open) == 20
            time.sleep(0.5)  # every stream past its first read
            queries = count_queries(app, seconds=2.0)
        finally:
            streams.close()
    ticks = 2.0 / POLL
    assert queries <= 2 * ticks, f"{queries} queries in {ticks:.0f} ticks"  # was ~20 a tick, one a stream


def count_queries(app: FastAPI, seconds: float) -> int:
    count = 0

    def counted(*args: Any) -> None:
        nonlocal count
        count += 1

    engine = app.state.services.engine
    event.listen(engine, "before_cursor_execute", counted)
    try:
        time.sleep(seconds)
    finally:
        event.remove(engine, "before_cursor_execute", counted)
    return count


def test_a_stream_gets_its_jobs_events_and_end_at_once(settings: Settings) -> None:
    with serving(settings) as (base, app):
        sessions = app.state.services.sessions
        key, job = queued_job(sessions, "tenant-a")
        lines: list[str] = []
        headers = {"Authorization": f"Bearer {key}"}
        with (
            httpx.Client(base_url=base, headers=headers, timeout=10) as client,
            client.stream("GET", f"/jobs/{job}/events/stream") as r,
        ):
            assert r.status_code == 200
            started = time.monotonic()
            for line in r.iter_lines():
                lines.append(line)
                if line == "retry: 2000":
                    with session_scope(sessions) as s:
                        jobs_db.add_event(s, job_id=job, kind="note", message="a first event")
                if line.startswith("data:") and '"note"' in line:
                    with session_scope(sessions) as s:
                        transition(s, job_id=job, src=JobStatus.QUEUED, dst=JobStatus.CANCELLED)
            took = time.monotonic() - started
    assert [x for x in lines if x.startswith("event:")] == ["event: end"]
    assert [x for x in lines if x][-1] == 'data: {"status":"cancelled"}'
    assert took < 2.0  # two changes, each seen within a tick or two (0.1 s)


@pytest.mark.slow
def test_another_tenants_jobs_stay_fast_while_one_opens_300_streams() -> None:
    """`ftune api` in a process of its own, polling every 0.2 s: tenant A asks for 300 streams of one
    queued job and gets its 16; tenant B's GET /jobs p95 stays under 150 ms (bench/sse_streams.py holds
    it to 100 ms). Measured on 2 busy cores: 16-19 ms; before the bound and the shared poller, 290-400 ms
    (the 300 streams' polls took a core)."""
    with sse_stack(FTUNE_SSE_POLL_SECONDS="0.2") as stack:
        a, b = stack.keys["tenant-a"], stack.keys["tenant-b"]
        probe_jobs(stack.base, b, seconds=1)  # warm the route up
        streams = open_streams(stack.base, a, stack.jobs["tenant-a"], 300)
        try:
            latencies = probe_jobs(stack.base, b, seconds=8)
        finally:
            streams.close()
    assert streams.statuses.count(200) == 16 and streams.statuses.count(429) == 284
    p95 = percentile(latencies, 0.95)
    assert p95 < 0.15, f"tenant B's GET /jobs p95 {p95 * 1000:.0f} ms beside tenant A's streams"
