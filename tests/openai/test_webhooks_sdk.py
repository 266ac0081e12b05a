"""Webhooks as OpenAI sends them (Standard Webhooks), checked with the official openai SDK's
`webhooks.unwrap`: signed, retried while a real local receiver fails, delivered exactly once per id, also
when the worker that delivers is killed (kill -9) between attempts and another one carries on."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select

from models import webhooks as webhooks_db
from models.db import make_engine, make_session_factory
from models.migrate import upgrade
from models.tables import WebhookEvent
from tests.e2e.stack import Proc, env_for, free_port
from tests.openai.conftest import TINY_RUN, Receiver, Stack, wait_for
from tests.worker.test_webhook_delivery import SECRET_KEY, finished_job

pytestmark = pytest.mark.slow
AGES = 10**6  # seconds: a signature check that accepts a delivery of any age


def test_webhooks_signed_retried_and_delivered_once_per_id(
    stack: Stack, org: tuple[openai.OpenAI, httpx.Client, str], receiver: Receiver, finished: Any
) -> None:
    """Every finished job of the package's tenant `org` (succeeded, cancelled) was announced to its
    webhook, a real local server that refused the first two attempts of every event."""
    sdk, native, _ = org
    secret = receiver.secret
    assert secret.startswith("whsec_")
    hooks = native.get("/webhooks").json()
    assert [h["url"] for h in hooks] == [receiver.url] and "secret" not in hooks[0]  # shown once
    assert native.post("/webhooks", json={"url": "ftp://x"}).status_code == 422
    cancelled = sdk.fine_tuning.jobs.create(
        model="ftune-demo", training_file=finished.training_file, extra_body=TINY_RUN
    )
    sdk.fine_tuning.jobs.cancel(cancelled.id)

    ended = {
        j.id: wait_for(sdk, j.id, {"succeeded", "cancelled"}).status for j in sdk.fine_tuning.jobs.list()
    }
    assert {"succeeded", "cancelled"} <= set(ended.values())
    deadline = time.monotonic() + 120
    while sum(1 for n in receiver.accepted().values() if n) < len(ended):
        assert time.monotonic() < deadline, receiver.received
        time.sleep(0.2)
    time.sleep(3)  # several delivery passes later: nothing more arrives for an accepted event

    events = {}
    for (headers, _, _), event in zip(receiver.received, receiver.unwrapped, strict=True):
        # every attempt verified when it arrived (the SDK refuses one older than 5 minutes), refused ones too
        assert not isinstance(event, Exception), event
        assert event.id == headers["webhook-id"]
        events[event.id] = (event.type, event.data.id)
    assert sorted(events.values()) == sorted(
        (f"fine_tuning.job.{st}", job_id) for job_id, st in ended.items()
    )
    assert receiver.accepted() == {event_id: 1 for event_id in events}  # exactly once per id
    assert len(receiver.received) == 3 * len(events)  # two refused attempts, then the accepted one

    # A tampered body or another secret fails the signature (any age: the check is the signature's).
    verifier = openai.OpenAI(api_key="unused", webhook_secret=secret)
    headers, body, _ = receiver.received[-1]
    verifier.webhooks.verify_signature(body, headers, tolerance=AGES)
    tampered = json.loads(body)
    tampered["data"]["id"] = "0" * 32
    with pytest.raises(openai.InvalidWebhookSignatureError):
        verifier.webhooks.verify_signature(json.dumps(tampered), headers, tolerance=AGES)
    other = openai.OpenAI(api_key="unused", webhook_secret=webhooks_db.new_secret())
    with pytest.raises(openai.InvalidWebhookSignatureError):
        other.webhooks.verify_signature(body, headers, tolerance=AGES)

    engine = make_engine(stack.database_url)  # every attempt is recorded
    try:
        with make_session_factory(engine)() as s:
            for event_id in events:
                attempts = webhooks_db.deliveries(s, event_id)
                assert [(a.attempt, a.status_code) for a in attempts] == [(1, 500), (2, 500), (3, 200)]
    finally:
        engine.dispose()


def test_a_pending_delivery_survives_a_kill_9_of_the_worker_and_is_sent_once(
    tmp_path: Path, embedded_broker: str
) -> None:
    """The process that delivers (a real `ftune worker`, whose tick sends due outbox events) is killed with
    SIGKILL while an event is failing (its receiver is down: connections refused); a new worker process
    delivers it once the receiver is up, and never again: the receiver counts one accepted delivery of
    that webhook-id, and every attempt is recorded."""
    url = f"sqlite:///{tmp_path / 'ftune.db'}"
    upgrade(url)
    engine = make_engine(url)
    sessions = make_session_factory(engine)
    port = free_port()
    secret, job_id = finished_job(sessions, f"http://127.0.0.1:{port}/hooks")  # nothing listens yet
    with sessions() as s:
        [event_id] = [e.id for e in s.scalars(select(WebhookEvent).where(WebhookEvent.job_id == job_id))]
    env = env_for(
        tmp_path,
        tmp_path / "models",
        FTUNE_DATABASE_URL=url,
        FTUNE_REDIS_URL=embedded_broker,
        FTUNE_REAPER_INTERVAL_SECONDS="0.3",  # the tick that delivers
        FTUNE_WEBHOOK_BACKOFF_SECONDS="0.2",
        FTUNE_WEBHOOK_TIMEOUT_SECONDS="2",
        FTUNE_WEBHOOK_ALLOW_PRIVATE="1",  # the receiver is on loopback
        FTUNE_SECRET_KEY=SECRET_KEY,  # the key finished_job sealed its secret with
    )

    def attempts() -> list[tuple[int, int | None, str | None]]:
        with sessions() as s:
            return [(a.attempt, a.status_code, a.error) for a in webhooks_db.deliveries(s, event_id)]

    first = Proc(["worker"], env, tmp_path / "worker1.log")
    receiver: Receiver | None = None
    second: Proc | None = None
    try:
        deadline = time.monotonic() + 120
        while len(attempts()) < 2:  # failing: two refused attempts recorded, the next one pending
            assert first.p.poll() is None and time.monotonic() < deadline, first.tail()
            time.sleep(0.1)
        os.kill(first.p.pid, signal.SIGKILL)
        assert first.p.wait(30) == -signal.SIGKILL
        failed = attempts()
        assert all(status is None and error for _, status, error in failed), failed
        with sessions() as s:
            event = s.get(WebhookEvent, event_id)
            assert event is not None and event.delivered_at is None and event.gave_up_at is None

        receiver = Receiver(fails=0, port=port)
        receiver.secret = secret
        second = Proc(["worker"], env, tmp_path / "worker2.log")
        deadline = time.monotonic() + 120
        while not receiver.accepted():
            assert second.p.poll() is None and time.monotonic() < deadline, second.tail()
            time.sleep(0.1)
        time.sleep(2)  # several ticks later: nothing more arrives for the accepted event
        assert receiver.accepted() == {event_id: 1} and len(receiver.received) == 1
        [event] = receiver.unwrapped  # signed as the SDK checks it, on arrival
        assert not isinstance(event, Exception), event
        assert (event.id, event.type, event.data.id) == (event_id, "fine_tuning.job.succeeded", job_id)
        recorded = attempts()
        assert recorded[: len(failed)] == failed and recorded[-1][1] == 200
        assert [a for a, _, _ in recorded] == list(range(1, len(recorded) + 1))
        assert all(status is None for _, status, _ in recorded[:-1])  # only refused attempts before it
    except BaseException:
        print(first.tail(), second.tail() if second else "", sep="\n")
        raise
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.stop()
        if receiver is not None:
            receiver.close()
        engine.dispose()
