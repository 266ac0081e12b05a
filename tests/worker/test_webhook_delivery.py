"""worker.webhooks.deliver_due on a real database, with the HTTP POST injected: signed as Standard
Webhooks (checked by the openai SDK), retried with backoff from the outbox across a restart (a new engine,
as a new worker process has), each attempt recorded, given up after the last one, never sent twice once
accepted. The receivers are on loopback, so these tests allow private destinations (the default refuses
them: tests/worker/test_webhook_hostile.py)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import openai
from pydantic import SecretStr
from sqlalchemy.orm import Session, sessionmaker

from core.secretbox import SecretBox
from core.settings import Settings
from models import webhooks as webhooks_db
from models.db import make_engine, make_session_factory, session_scope
from models.tables import WebhookEvent, utcnow
from models.tenants import get_or_create_tenant
from tests.rows import succeeded_job
from worker.webhooks import backoff, deliver_due

# The key that seals webhook secrets, shared by the tests' registrations and their workers (FTUNE_SECRET_KEY).
SECRET_KEY = "test-key-0123456789abcdef0123456789"
BOX = SecretBox(SECRET_KEY.encode())


def settings_for(**values: Any) -> Settings:
    """Delivery settings for loopback receivers, with the tests' key."""
    return Settings(**({"secret_key": SecretStr(SECRET_KEY), "webhook_allow_private": True} | values))


class Receiver:
    """A POST double: answers each call with the next of `answers` (an int status or an exception)."""

    def __init__(self, *answers: int | Exception) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str, bytes, dict[str, str]]] = []
        self.addresses: list[str] = []

    def __call__(self, url: str, address: str, body: bytes, headers: dict[str, str], timeout: float) -> int:
        self.calls.append((url, body, headers))
        self.addresses.append(address)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def finished_job(sessions: sessionmaker[Session], url: str, tenant_name: str = "") -> tuple[str, str]:
    """A tenant with a webhook on `url` and a job that just succeeded: (secret, job id)."""
    with session_scope(sessions) as s:
        tenant = get_or_create_tenant(s, tenant_name or f"t{time.time_ns()}").id
        secret = webhooks_db.register(s, tenant_id=tenant, url=url, box=BOX).secret
        job_id = succeeded_job(s, tenant)
    return secret, job_id


def make_due(sessions: sessionmaker[Session]) -> None:
    """Skip the backoff wait: every pending event is due now."""
    with session_scope(sessions) as s:
        for e in s.query(WebhookEvent).filter(WebhookEvent.delivered_at.is_(None)):
            e.next_attempt_at = utcnow() - timedelta(seconds=1)


def test_signed_retried_across_a_restart_and_sent_once(
    migrated_url: str, sessions: sessionmaker[Session]
) -> None:
    settings = settings_for(webhook_backoff_seconds=30)
    secret, job_id = finished_job(sessions, "http://localhost:9/hook")
    post = Receiver(500, ConnectionRefusedError("refused"), 204)
    assert deliver_due(sessions, settings, post) == 0
    assert deliver_due(sessions, settings, post) == 0  # backing off: not due yet
    assert len(post.calls) == 1
    make_due(sessions)
    assert deliver_due(sessions, settings, post) == 0  # the connection is refused

    engine = make_engine(migrated_url)  # a new worker process: only the outbox carries over
    try:
        restarted = make_session_factory(engine)
        make_due(restarted)
        assert deliver_due(restarted, settings, post) == 1
        make_due(restarted)
        assert deliver_due(restarted, settings, post) == 0 and len(post.calls) == 3  # accepted: never again
    finally:
        engine.dispose()

    ids = {headers["webhook-id"] for _, _, headers in post.calls}
    assert len(ids) == 1  # the same id on every attempt
    verifier = openai.OpenAI(api_key="unused", webhook_secret=secret)
    assert set(post.addresses) <= {"127.0.0.1", "::1"}  # the address checked is the one connected to
    for url, body, headers in post.calls:
        assert url == "http://localhost:9/hook"
        event = verifier.webhooks.unwrap(body, headers)
        assert (event.type, event.data.id, event.id) == (
            "fine_tuning.job.succeeded",
            job_id,
            headers["webhook-id"],
        )
    with sessions() as s:
        attempts = webhooks_db.deliveries(s, ids.pop())
        assert [(a.attempt, a.status_code, bool(a.error)) for a in attempts] == [
            (1, 500, False),
            (2, None, True),
            (3, 204, False),
        ]


def test_gives_up_after_the_last_attempt(sessions: sessionmaker[Session]) -> None:
    settings = settings_for(webhook_max_attempts=2)
    _, job_id = finished_job(sessions, "http://127.0.0.1:9/gone")
    post = Receiver(410, 404)
    deliver_due(sessions, settings, post)
    make_due(sessions)
    deliver_due(sessions, settings, post)
    make_due(sessions)
    assert deliver_due(sessions, settings, post) == 0 and len(post.calls) == 2
    with sessions() as s:
        [event] = s.query(WebhookEvent).filter_by(job_id=job_id).all()
        assert event.attempts == 2
        assert event.gave_up_at is not None and event.delivered_at is None


def test_backoff_doubles_up_to_an_hour() -> None:
    settings = Settings(webhook_backoff_seconds=5)
    assert [backoff(settings, n) for n in (1, 2, 3)] == [5, 10, 20]
    assert backoff(settings, 30) == 3600
