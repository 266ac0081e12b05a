"""Webhooks: endpoints per tenant, the outbox of job events, and the claim/record steps of delivery.

An event is written in the same transaction as the job's terminal transition (models/transitions.py),
so it exists exactly when the job finished. Delivery claims an event by compare-and-set on its attempt
count (two workers never send the same attempt, and none past the last), records every attempt, and backs off
between them. Secrets are sealed at rest (core.secretbox) with the endpoint's id as context; a plain
`whsec_...` of a row from before is read as it is.
"""

from __future__ import annotations

import base64
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from core.errors import Conflict, NotFound
from core.secretbox import PREFIX, SecretBox, SecretUnreadable, is_sealed
from core.settings import get_settings
from core.states import JobStatus
from models.db import rows_changed
from models.tables import Job, Tenant, Webhook, WebhookDelivery, WebhookEvent, utcnow

EVENT_TYPES = {
    JobStatus.SUCCEEDED: "fine_tuning.job.succeeded",
    JobStatus.FAILED: "fine_tuning.job.failed",
    JobStatus.CANCELLED: "fine_tuning.job.cancelled",
}
WEBHOOK_ID_RE = re.compile(r"^wh_[0-9a-f]{24}$")


def new_secret() -> str:
    """A Standard Webhooks secret: whsec_ + base64 of 32 random bytes."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def _box(box: SecretBox | None) -> SecretBox:
    return box if box is not None else SecretBox.from_settings(get_settings())


def seal(box: SecretBox, secret: str, *, webhook_id: str) -> str:
    return box.seal(base64.b64decode(secret.removeprefix("whsec_")), context=webhook_id)


def unseal(box: SecretBox, stored: str, *, webhook_id: str) -> str:
    """The secret in the clear (SecretUnreadable where this key does not open it)."""
    if not is_sealed(stored):
        return stored  # a row from before secrets were sealed
    return "whsec_" + base64.b64encode(box.open(stored, context=webhook_id)).decode()


def seal_plain_secrets(session: Session, box: Callable[[], SecretBox]) -> int:
    """Seal every secret still held as a plain `whsec_...` (rows from before secrets were sealed), each
    only if it is still that value (a rotation meanwhile wins); returns how many were sealed. The API runs
    it at its start, so such a row does not wait for its next rotation. `box` is asked for only when there
    is one to seal (making it may make the key file)."""
    sealed = 0
    plain = (Webhook.secret.not_like(f"{PREFIX}%"), Webhook.previous_secret.not_like(f"{PREFIX}%"))
    for hook in session.scalars(select(Webhook).where(plain[0] | plain[1])).all():
        for column in (Webhook.secret, Webhook.previous_secret):
            value = getattr(hook, column.key)
            if value and not is_sealed(value):
                done = session.execute(
                    update(Webhook)
                    .where(Webhook.id == hook.id, column == value)
                    .values({column.key: seal(box(), value, webhook_id=hook.id)})
                )
                sealed += rows_changed(done)
    return sealed


@dataclass(frozen=True)
class Endpoint:
    """A webhook as its owner gets it back, with its secret in the clear: at registration and at rotation."""

    id: str
    url: str
    created_at: datetime
    secret: str
    previous_secret_expires_at: datetime | None = None


def register(
    session: Session, *, tenant_id: str, url: str, box: SecretBox | None = None, limit: int | None = None
) -> Endpoint:
    """A new endpoint with a new secret; Conflict `webhook_limit_reached` if the tenant has `limit`."""
    if limit is not None:
        # Registrations of one tenant take their turn (PostgreSQL; SQLite writes one at a time anyway).
        session.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())
        count = session.scalar(
            select(func.count()).where(Webhook.tenant_id == tenant_id, Webhook.deleted_at.is_(None))
        )
        if (count or 0) >= limit:
            raise Conflict(
                f"a tenant may have at most {limit} webhooks; delete one first",
                code="webhook_limit_reached",
                details={"limit": limit},
            )
    secret, hook_id = new_secret(), f"wh_{secrets.token_hex(12)}"
    hook = Webhook(
        id=hook_id, tenant_id=tenant_id, url=url, secret=seal(_box(box), secret, webhook_id=hook_id)
    )
    session.add(hook)
    session.flush()
    return Endpoint(hook.id, hook.url, hook.created_at, secret)


def list_webhooks(session: Session, tenant_id: str) -> list[Webhook]:
    stmt = select(Webhook).where(Webhook.tenant_id == tenant_id, Webhook.deleted_at.is_(None))
    return list(session.scalars(stmt.order_by(Webhook.created_at)))


def get_owned(session: Session, *, tenant_id: str, webhook_id: str) -> Webhook:
    """The tenant's endpoint `webhook_id`; NotFound for another tenant's, a deleted one, or none."""
    hook = session.get(Webhook, webhook_id) if WEBHOOK_ID_RE.match(webhook_id) else None
    if hook is None or hook.tenant_id != tenant_id or hook.deleted_at is not None:
        raise NotFound(f"no webhook {webhook_id!r}", code="webhook_not_found", param="webhook_id")
    return hook


def delete(session: Session, *, tenant_id: str, webhook_id: str) -> None:
    """Delete an endpoint: its secrets are cleared and its pending events given up (an attempt in flight
    ends, and is recorded, as it would have). Its row stays: its events and their deliveries refer to it."""
    hook = get_owned(session, tenant_id=tenant_id, webhook_id=webhook_id)
    now = utcnow()
    hook.deleted_at, hook.secret, hook.previous_secret, hook.previous_secret_expires_at = now, "", None, None
    session.execute(
        update(WebhookEvent)
        .where(
            WebhookEvent.webhook_id == webhook_id,
            WebhookEvent.delivered_at.is_(None),
            WebhookEvent.gave_up_at.is_(None),
        )
        .values(gave_up_at=now, next_attempt_at=None)
    )


def rotate(
    session: Session, *, tenant_id: str, webhook_id: str, grace_seconds: float, box: SecretBox | None = None
) -> Endpoint:
    """A new secret for an endpoint; the current one still signs for `grace_seconds` (with the new one), and
    one rotated before is dropped now."""
    box = _box(box)
    hook = get_owned(session, tenant_id=tenant_id, webhook_id=webhook_id)
    now = utcnow()
    try:
        current = unseal(box, hook.secret, webhook_id=hook.id)
    except SecretUnreadable:
        current = None  # sealed with another key: it cannot sign, so it is not kept
    secret = new_secret()
    hook.secret = seal(box, secret, webhook_id=hook.id)
    if current is not None and grace_seconds > 0:
        hook.previous_secret = seal(box, current, webhook_id=hook.id)
        hook.previous_secret_expires_at = now + timedelta(seconds=grace_seconds)
    else:
        hook.previous_secret, hook.previous_secret_expires_at = None, None
    session.flush()
    return Endpoint(hook.id, hook.url, hook.created_at, secret, hook.previous_secret_expires_at)


def add_job_event(session: Session, *, job_id: str, status: JobStatus) -> list[WebhookEvent]:
    """One outbox row per endpoint of the job's tenant for a job that just reached `status`."""
    kind = EVENT_TYPES.get(status)
    tenant_id = session.scalar(select(Job.tenant_id).where(Job.id == job_id))
    if kind is None or tenant_id is None:
        return []
    now = utcnow()
    rows = []
    hooks = select(Webhook).where(Webhook.tenant_id == tenant_id, Webhook.deleted_at.is_(None))
    for hook in session.scalars(hooks):
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


class Due(NamedTuple):
    """An event waiting for an attempt: its id, the attempts so far, and whose endpoint it goes to."""

    event_id: str
    attempts: int
    tenant_id: str
    url: str


def due(
    session: Session,
    *,
    now: datetime,
    limit: int = 50,
    max_attempts: int | None = None,
    per_tenant: int | None = None,
) -> list[Due]:
    """Events waiting for an attempt (of endpoints not deleted, below `max_attempts`), at most `limit`.
    Tenants take turns: each tenant's oldest first, at most `per_tenant` of each (None: all), and every
    tenant's n-th event before anyone's (n+1)-th, so one tenant's backlog cannot fill the list."""
    # ROW_NUMBER() numbers each tenant's due events by age (SQLite >= 3.25 and PostgreSQL alike).
    turn = func.row_number().over(
        partition_by=Webhook.tenant_id, order_by=(WebhookEvent.next_attempt_at, WebhookEvent.id)
    )
    waiting = (
        select(
            WebhookEvent.id,
            WebhookEvent.attempts,
            Webhook.tenant_id,
            Webhook.url,
            WebhookEvent.next_attempt_at.label("due_at"),
            turn.label("turn"),
        )
        .join(Webhook, Webhook.id == WebhookEvent.webhook_id)
        .where(
            WebhookEvent.delivered_at.is_(None),
            WebhookEvent.gave_up_at.is_(None),
            WebhookEvent.next_attempt_at <= now,
            Webhook.deleted_at.is_(None),
        )
    )
    if max_attempts is not None:
        waiting = waiting.where(WebhookEvent.attempts < max_attempts)
    w = waiting.subquery()
    stmt = select(w.c.id, w.c.attempts, w.c.tenant_id, w.c.url).order_by(w.c.turn, w.c.due_at, w.c.id)
    if per_tenant is not None:
        stmt = stmt.where(w.c.turn <= per_tenant)
    return [Due(*row) for row in session.execute(stmt.limit(limit))]


def give_up_exhausted(session: Session, *, now: datetime, max_attempts: int) -> int:
    """Give up the events whose last attempt was claimed and never recorded (its worker died or hung past
    the lease): no attempt is claimed past the last one. Returns how many."""
    result = session.execute(
        update(WebhookEvent)
        .where(
            WebhookEvent.delivered_at.is_(None),
            WebhookEvent.gave_up_at.is_(None),
            WebhookEvent.attempts >= max_attempts,
            WebhookEvent.next_attempt_at <= now,
        )
        .values(gave_up_at=now, next_attempt_at=None)
    )
    return rows_changed(result)


def claim(
    session: Session,
    *,
    event_id: str,
    attempts: int,
    now: datetime,
    lease_seconds: float,
    max_attempts: int | None = None,
) -> bool:
    """Take the next attempt of an event; while it is in flight, no other worker may (until the lease ends,
    after which a worker that died mid-attempt is replaced). None past `max_attempts`."""
    stmt = update(WebhookEvent).where(
        WebhookEvent.id == event_id,
        WebhookEvent.attempts == attempts,
        WebhookEvent.delivered_at.is_(None),
        WebhookEvent.gave_up_at.is_(None),
    )
    if max_attempts is not None:
        stmt = stmt.where(WebhookEvent.attempts < max_attempts)
    result = session.execute(
        stmt.values(attempts=attempts + 1, next_attempt_at=now + timedelta(seconds=lease_seconds))
    )
    return rows_changed(result) == 1


class WebhookGone(Exception):
    """The event's endpoint was deleted (while its attempt was on its way)."""


class Target(NamedTuple):
    url: str
    secrets: list[str]  # the current secret, and a rotated one still in its grace period
    payload: dict[str, Any]


def target(session: Session, event_id: str, *, box: SecretBox | None = None) -> Target:
    """Where an event goes and the secrets that sign it (SecretUnreadable where the key cannot open them,
    WebhookGone where the endpoint was deleted)."""
    event = session.get(WebhookEvent, event_id)
    assert event is not None
    hook = session.get(Webhook, event.webhook_id)
    assert hook is not None
    if hook.deleted_at is not None:
        raise WebhookGone(f"webhook {hook.id} was deleted")
    box = _box(box)
    keys = [unseal(box, hook.secret, webhook_id=hook.id)]
    until = hook.previous_secret_expires_at
    if hook.previous_secret and until is not None and until > utcnow():
        keys.append(unseal(box, hook.previous_secret, webhook_id=hook.id))
    return Target(hook.url, keys, event.payload)


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


class DeliveryRow(NamedTuple):
    delivery: WebhookDelivery
    event_type: str
    job_id: str


def list_deliveries(
    session: Session, *, webhook_id: str, limit: int, before: int | None
) -> tuple[list[DeliveryRow], int | None]:
    """An endpoint's delivery attempts, newest first, `limit` of them with ids below `before`; and the id to
    pass as `before` for the next page (None at the end)."""
    stmt = (
        select(WebhookDelivery, WebhookEvent.type, WebhookEvent.job_id)
        .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
        .where(WebhookEvent.webhook_id == webhook_id)
        .order_by(WebhookDelivery.id.desc())
        .limit(limit + 1)
    )
    if before is not None:
        stmt = stmt.where(WebhookDelivery.id < before)
    rows = [DeliveryRow(*row) for row in session.execute(stmt)]
    if len(rows) <= limit:
        return rows, None
    return rows[:limit], rows[limit - 1].delivery.id
