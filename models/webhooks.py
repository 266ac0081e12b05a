"""Webhooks: endpoints per tenant, the outbox of job events, and the claim/record steps of delivery.

An event is written in the same transaction as the job's terminal transition (models/transitions.py),
so it exists exactly when the job finished. Delivery claims an event by compare-and-set on its attempt
count (two workers never send the same attempt), records every attempt, and backs off between them.
"""

from __future__ import annotations

import base64
import secrets
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core.states import JobStatus
from models.tables import Job, Webhook, WebhookDelivery, WebhookEvent, utcnow

EVENT_TYPES = {
    JobStatus.SUCCEEDED: "fine_tuning.job.succeeded",
    JobStatus.FAILED: "fine_tuning.job.failed",
    JobStatus.CANCELLED: "fine_tuning.job.cancelled",
}


def new_secret() -> str:
    """A Standard Webhooks secret: whsec_ + base64 of 32 random bytes."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def register(session: Session, *, tenant_id: str, url: str) -> Webhook:
    hook = Webhook(id=f"wh_{secrets.token_hex(12)}", tenant_id=tenant_id, url=url, secret=new_secret())
    session.add(hook)
    session.flush()
    return hook


def list_webhooks(session: Session, tenant_id: str) -> list[Webhook]:
    return list(
        session.scalars(select(Webhook).where(Webhook.tenant_id == tenant_id).order_by(Webhook.created_at))
    )


def add_job_event(session: Session, *, job_id: str, status: JobStatus) -> list[WebhookEvent]:
    """One outbox row per endpoint of the job's tenant for a job that just reached `status`."""
    kind = EVENT_TYPES.get(status)
    tenant_id = session.scalar(select(Job.tenant_id).where(Job.id == job_id))
    if kind is None or tenant_id is None:
        return []
    now = utcnow()
    rows = []
    for hook in session.scalars(select(Webhook).where(Webhook.tenant_id == tenant_id)):
        event_id = f"evt_{secrets.token_hex(16)}"
        payload = {
            "id": event_id,
            "object": "event",
            "created_at": int(now.timestamp()),
            "type": kind,
            "data": {"id": job_id},
        }
        row = WebhookEvent(
            id=event_id,
            webhook_id=hook.id,
            job_id=job_id,
            type=kind,
            payload=payload,
            created_at=now,
            attempts=0,
            next_attempt_at=now,
        )
        session.add(row)
        rows.append(row)
    return rows


def due(session: Session, *, now: datetime, limit: int = 50) -> list[tuple[str, int]]:
    """(event id, attempts so far) of events waiting for an attempt, oldest first."""
    stmt = (
        select(WebhookEvent.id, WebhookEvent.attempts)
        .where(
            WebhookEvent.delivered_at.is_(None),
            WebhookEvent.gave_up_at.is_(None),
            WebhookEvent.next_attempt_at <= now,
        )
        .order_by(WebhookEvent.next_attempt_at)
        .limit(limit)
    )
    return [(row[0], row[1]) for row in session.execute(stmt)]


def claim(session: Session, *, event_id: str, attempts: int, now: datetime, lease_seconds: float) -> bool:
    """Take the next attempt of an event; while it is in flight, no other worker may (until the lease ends,
    after which a worker that died mid-attempt is replaced)."""
    result = session.execute(
        update(WebhookEvent)
        .where(
            WebhookEvent.id == event_id,
            WebhookEvent.attempts == attempts,
            WebhookEvent.delivered_at.is_(None),
        )
        .values(attempts=attempts + 1, next_attempt_at=now + timedelta(seconds=lease_seconds))
    )
    return result.rowcount == 1  # type: ignore[attr-defined]


def target(session: Session, event_id: str) -> tuple[str, str, dict[str, Any]]:
    """(url, secret, payload) of an event."""
    event = session.get(WebhookEvent, event_id)
    assert event is not None
    hook = session.get(Webhook, event.webhook_id)
    assert hook is not None
    return hook.url, hook.secret, event.payload


def record_attempt(
    session: Session,
    *,
    event_id: str,
    attempt: int,
    started_at: datetime,
    status_code: int | None,
    error: str | None,
    retry_at: datetime | None,
) -> None:
    """Record an attempt: a 2xx delivers the event, else it is due again at `retry_at` (None: give up)."""
    session.add(
        WebhookDelivery(
            event_id=event_id, attempt=attempt, started_at=started_at, status_code=status_code, error=error
        )
    )
    now = utcnow()
    values: dict[str, Any]
    if status_code is not None and 200 <= status_code < 300:
        values = {"delivered_at": now, "next_attempt_at": None}
    elif retry_at is None:
        values = {"gave_up_at": now, "next_attempt_at": None}
    else:
        values = {"next_attempt_at": retry_at}
    session.execute(
        update(WebhookEvent)
        .where(WebhookEvent.id == event_id, WebhookEvent.attempts == attempt)
        .values(**values)
    )


def deliveries(session: Session, event_id: str) -> list[WebhookDelivery]:
    stmt = select(WebhookDelivery).where(WebhookDelivery.event_id == event_id).order_by(WebhookDelivery.id)
    return list(session.scalars(stmt))
