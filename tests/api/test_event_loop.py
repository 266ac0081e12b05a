"""No async route blocks the event loop on the database: while an upload waits on a locked table, a real
uvicorn server keeps answering other requests at once.

The lock is a real one (another connection's write transaction on the idempotency table), so the upload's
first database write (claiming its Idempotency-Key) waits for it, as on a slow or busy database.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from sqlalchemy import create_engine, text

from api.main import create_app
from core.settings import Settings
from tests.api.conftest import ALPACA, RecordingEnqueuer, RecordingTokenStats, new_key
from tests.e2e.stack import uvicorn_thread


@contextmanager
def serving(settings: Settings) -> Iterator[tuple[str, dict[str, str]]]:
    app = create_app(settings, enqueue=RecordingEnqueuer(), token_stats=RecordingTokenStats())
    with uvicorn_thread(app) as base:
        yield base, new_key(app, "acme")


@contextmanager
def idempotency_table_locked(url: str) -> Iterator[None]:
    """Another connection holds a write lock that an INSERT into idempotency_keys must wait for."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")  # the database's write lock; readers go on (WAL)
        try:
            yield
        finally:
            conn.execute("ROLLBACK")
            conn.close()
        return
    engine = create_engine(url)
    with engine.connect() as conn:
        conn.execute(text("LOCK TABLE idempotency_keys IN EXCLUSIVE MODE"))  # reads go on
        try:
            yield
        finally:
            conn.rollback()
    engine.dispose()


def test_health_answers_while_an_upload_waits_on_the_database(settings: Settings) -> None:
    with serving(settings) as (base, auth):
        answers: list[httpx.Response] = []

        def upload() -> None:
            headers = {**auth, "Idempotency-Key": "slow-db"}
            with httpx.Client(timeout=60) as c:
                answers.append(
                    c.post(f"{base}/datasets", files={"file": ("a.jsonl", ALPACA)}, headers=headers)
                )

        with idempotency_table_locked(settings.database_url):
            uploader = threading.Thread(target=upload)
            uploader.start()
            time.sleep(1.0)  # the upload is in flight, waiting for the lock
            assert uploader.is_alive() and not answers
            started = time.monotonic()
            health = httpx.get(f"{base}/health", timeout=10)
            jobs = httpx.get(f"{base}/jobs", headers=auth, timeout=10)
            waited = time.monotonic() - started
            assert health.status_code == 200 and jobs.status_code == 200
            assert waited < 2, f"the event loop was blocked for {waited:.1f} s"
            assert uploader.is_alive(), "the lock should still hold the upload"
        uploader.join(60)
    assert [r.status_code for r in answers] == [201], answers[0].text if answers else "no answer"
