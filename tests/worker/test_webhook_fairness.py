"""Fair webhook dispatch on a real database, with real HTTP receivers on 127.0.0.1: due events are taken
per tenant in turns (at most a tenant's in-flight cap each), so a tenant with a backlog of 250 due events
does not starve another tenant's one event, and threads freed by finished attempts take the next due
events at once instead of waiting for the worker's next tick."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from core.states import JobStatus
from models import webhooks as webhooks_db
from models.db import session_scope
from models.tables import Webhook, WebhookEvent, utcnow
from tests.worker.test_webhook_delivery import finished_job, settings_for
from worker.webhooks import Deliverer


class Receivers:
    """A real HTTP server on 127.0.0.1 that answers 204 after `delay` seconds, counting the requests per
    path and the most it answered at once per path."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay, self.lock = delay, threading.Lock()
        self.seen: dict[str, int] = {}
        self.now: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        receivers = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                receivers.enter(self.path)
                try:
                    time.sleep(receivers.delay)
                    self.send_response(204)
                    self.end_headers()
                finally:
                    receivers.leave(self.path)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.server.server_address[1]}{path}"

    def enter(self, path: str) -> None:
        with self.lock:
            self.seen[path] = self.seen.get(path, 0) + 1
            self.now[path] = self.now.get(path, 0) + 1
            self.peak[path] = max(self.peak.get(path, 0), self.now[path])

    def leave(self, path: str) -> None:
        with self.lock:
            self.now[path] -= 1

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receivers() -> Iterator[Receivers]:
    r = Receivers(delay=0.2)
    try:
        yield r
    finally:
        r.close()


def backlog(sessions: sessionmaker[Session], url: str, tenant: str, events: int, age_s: float) -> str:
    """A tenant whose webhook on `url` has `events` due events, due for `age_s` seconds: its id."""
    _, job_id = finished_job(sessions, url, tenant_name=tenant)
    with session_scope(sessions) as s:
        for _ in range(events - 1):
            webhooks_db.add_job_event(s, job_id=job_id, status=JobStatus.SUCCEEDED)
        s.flush()
        hook_ids = [h for (h,) in s.query(WebhookEvent.webhook_id).filter_by(job_id=job_id).distinct()]
        s.execute(
            update(WebhookEvent)
            .where(WebhookEvent.webhook_id.in_(hook_ids))
            .values(next_attempt_at=utcnow() - timedelta(seconds=age_s))
        )
        [tenant_id] = {t for (t,) in s.query(Webhook.tenant_id).filter(Webhook.id.in_(hook_ids))}
    return tenant_id


def delivered(sessions: sessionmaker[Session], tenant_id: str) -> int:
    with sessions() as s:
        return (
            s.query(WebhookEvent)
            .join(Webhook, Webhook.id == WebhookEvent.webhook_id)
            .filter(Webhook.tenant_id == tenant_id, WebhookEvent.delivered_at.is_not(None))
            .count()
        )


def test_a_victims_event_is_delivered_in_one_pass_beside_a_backlog_of_250(
    sessions: sessionmaker[Session], receivers: Receivers
) -> None:
    """Tenant A has 250 due events, all older than tenant B's one: one pass sends A its share (its cap,
    2) and B's event, which is delivered by the end of that pass."""
    a = backlog(sessions, receivers.url("/a"), "tenant-a", events=250, age_s=60)
    # another host: the per-host cap (2) is not what is tested here
    b = backlog(sessions, receivers.url("/b", host="localhost"), "tenant-b", events=1, age_s=0)
    settings = settings_for(webhook_concurrency=8, webhook_max_in_flight_per_tenant=2)
    deliverer = Deliverer(sessions, settings)
    try:
        assert deliverer.run_pass() == 3
    finally:
        deliverer.close(wait=True)
    assert receivers.seen == {"/a": 2, "/b": 1}
    assert receivers.peak["/a"] <= 2
    assert delivered(sessions, b) == 1 and delivered(sessions, a) == 2


def test_due_events_are_taken_per_tenant_in_turns(sessions: sessionmaker[Session]) -> None:
    """The query itself: at most `per_tenant` events of each tenant, each tenant's oldest first, and the
    tenants' first events before anyone's second."""
    a = backlog(sessions, "http://127.0.0.1:9/a", "turns-a", events=5, age_s=30)
    b = backlog(sessions, "http://127.0.0.1:9/b", "turns-b", events=1, age_s=10)
    c = backlog(sessions, "http://127.0.0.1:9/c", "turns-c", events=3, age_s=20)
    with sessions() as s:
        due = webhooks_db.due(s, now=utcnow(), limit=200, per_tenant=2)
    assert [d.tenant_id for d in due] == [a, c, b, a, c]
    with sessions() as s:
        assert len(webhooks_db.due(s, now=utcnow(), limit=4, per_tenant=2)) == 4
        assert len(webhooks_db.due(s, now=utcnow(), limit=200)) == 9  # no cap: every due event


def test_freed_threads_take_the_next_due_events_without_a_tick(
    sessions: sessionmaker[Session], receivers: Receivers
) -> None:
    """One poke (the worker's tick) and a tenant's 8 due events: its 2 threads go on to the next events
    as their attempts end, so all 8 are delivered before any further tick."""
    a = backlog(sessions, receivers.url("/a"), "refill-a", events=8, age_s=1)
    settings = settings_for(webhook_concurrency=8, webhook_max_in_flight_per_tenant=2)
    deliverer = Deliverer(sessions, settings)
    try:
        deliverer.poke()
        deadline = time.monotonic() + 10
        while delivered(sessions, a) < 8:
            assert time.monotonic() < deadline, f"{delivered(sessions, a)} of 8 delivered"
            time.sleep(0.05)
        assert receivers.peak["/a"] <= 2
    finally:
        deliverer.close(wait=True)
