"""Webhook delivery: send due outbox events, signed as Standard Webhooks, and record every attempt.

Headers: webhook-id (the event id, the same on every retry, so a receiver can drop a repeat),
webhook-timestamp (unix seconds of this attempt) and webhook-signature `v1,<base64 HMAC-SHA256 of
"<id>.<timestamp>.<body>">` keyed by the secret's base64-decoded bytes after `whsec_`. Any 2xx delivers;
anything else (an error status, a timeout, a refused connection) is retried with exponential backoff
from the outbox, so a restarted worker (or another one) carries on where this one stopped.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
from collections.abc import Callable
from datetime import timedelta

import httpx
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from models import webhooks as webhooks_db
from models.db import session_scope
from models.tables import utcnow

log = logging.getLogger(__name__)
MAX_BACKOFF_SECONDS = 3600.0
Post = Callable[[str, bytes, dict[str, str], float], int]  # url, body, headers, timeout -> status code


def sign(secret: str, event_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{event_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def http_post(url: str, body: bytes, headers: dict[str, str], timeout: float) -> int:
    # No redirects: a signed event goes to the registered URL only.
    return httpx.post(url, content=body, headers=headers, timeout=timeout, follow_redirects=False).status_code


def backoff(settings: Settings, attempt: int) -> float:
    return float(min(settings.webhook_backoff_seconds * 2 ** (attempt - 1), MAX_BACKOFF_SECONDS))


def deliver_due(sessions: sessionmaker[Session], settings: Settings, post: Post = http_post) -> int:
    """One pass: attempt every due event once; returns how many were delivered."""
    delivered = 0
    with sessions() as s:
        due = webhooks_db.due(s, now=utcnow())
    for event_id, attempts in due:
        lease = settings.webhook_timeout_seconds + 30  # longer than an attempt can take
        with session_scope(sessions) as s:
            if not webhooks_db.claim(
                s, event_id=event_id, attempts=attempts, now=utcnow(), lease_seconds=lease
            ):
                continue  # another worker took this attempt
            url, secret, payload = webhooks_db.target(s, event_id)
        attempt = attempts + 1
        started = utcnow()
        timestamp = int(started.timestamp())
        body = json.dumps(payload, separators=(",", ":")).encode()
        headers = {
            "content-type": "application/json",
            "webhook-id": event_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(secret, event_id, timestamp, body),
        }
        status: int | None = None
        error: str | None = None
        try:
            status = post(url, body, headers, settings.webhook_timeout_seconds)
        except httpx.HTTPError as e:
            error = f"{type(e).__name__}: {e}"[:2000]
        ok = status is not None and 200 <= status < 300
        retry_at = None
        if not ok and attempt < settings.webhook_max_attempts:
            retry_at = utcnow() + timedelta(seconds=backoff(settings, attempt))
        with session_scope(sessions) as s:
            webhooks_db.record_attempt(
                s,
                event_id=event_id,
                attempt=attempt,
                started_at=started,
                status_code=status,
                error=error,
                retry_at=retry_at,
            )
        if ok:
            delivered += 1
        else:
            log.info(
                "webhook %s attempt %d failed (%s); retry at %s", event_id, attempt, status or error, retry_at
            )
    return delivered
