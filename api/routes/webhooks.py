"""Webhooks: a tenant registers URLs for signed job events (fine_tuning.job.succeeded|failed|cancelled,
Standard Webhooks); the secret is shown once, at registration, and again at each rotation. The workers
deliver (worker/webhooks.py); each endpoint's attempts can be read back.

A URL whose host is, or resolves to, a loopback, private, link-local, multicast, unspecified or reserved
address is refused (400 webhook_url_not_allowed, core.net) unless the operator allows private destinations
(FTUNE_WEBHOOK_ALLOW_PRIVATE); the workers check it again at each delivery."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import AnyHttpUrl, BaseModel, Field

from api.auth import PrincipalDep
from api.deps import ServicesDep, SessionDep
from api.responses import AUTHED, errors
from api.schemas import Page
from core import net
from core.errors import FtuneError, InvalidInput
from core.secretbox import SecretBox
from models import webhooks as webhooks_db
from models.db import session_scope
from models.tables import Webhook

router = APIRouter(prefix="/webhooks", tags=["webhooks"], responses=errors(*AUTHED))


class WebhookIn(BaseModel):
    url: AnyHttpUrl = Field(description="An http or https URL that accepts POSTed JSON events.")


class WebhookOut(BaseModel):
    id: str
    url: str
    created_at: datetime
    events: list[str] = sorted(webhooks_db.EVENT_TYPES.values())
    previous_secret_expires_at: datetime | None = Field(
        default=None,
        description="After a rotation: until when the previous secret still signs (with the new).",
    )


class WebhookCreated(WebhookOut):
    secret: str = Field(description="whsec_...: verifies the webhook-signature header; shown only now.")


class DeliveryOut(BaseModel):
    id: int
    event_id: str
    event_type: str
    job_id: str
    attempt: int
    started_at: datetime
    status_code: int | None = Field(description="The receiver's answer; null when none came.")
    error: str | None = Field(
        description="Why no answer came (e.g. `refused: ...`: the destination is not allowed)."
    )


def _out(hook: Webhook) -> WebhookOut:
    return WebhookOut(
        id=hook.id,
        url=hook.url,
        created_at=hook.created_at,
        previous_secret_expires_at=hook.previous_secret_expires_at,
    )


def _created(hook: webhooks_db.Endpoint) -> WebhookCreated:
    return WebhookCreated(
        id=hook.id,
        url=hook.url,
        created_at=hook.created_at,
        previous_secret_expires_at=hook.previous_secret_expires_at,
        secret=hook.secret,
    )


def check_url(url: str, *, allow_private: bool, timeout: float, tenant_id: str) -> None:
    """Refuse (400 webhook_url_not_allowed, param url) a URL ftune would not deliver to, or whose host does
    not resolve within `timeout` seconds (the tenant's lookups are bounded as at delivery: core.net)."""
    try:
        net.checked_address(url, allow_private=allow_private, timeout=timeout, owner=tenant_id)
    except net.AddressRefused as e:
        raise FtuneError(e.reason, code="webhook_url_not_allowed", param="url") from e
    except net.LookupFailed as e:
        raise FtuneError(str(e), code="webhook_url_not_allowed", param="url") from e
    except (OSError, UnicodeError) as e:
        message = "the URL's host does not resolve"
        raise FtuneError(message, code="webhook_url_not_allowed", param="url") from e


@router.post("", status_code=201, response_model=WebhookCreated, responses=errors(400, 409))
def register_webhook(body: WebhookIn, services: ServicesDep, principal: PrincipalDep) -> WebhookCreated:
    """Register an endpoint (at most FTUNE_MAX_WEBHOOKS_PER_TENANT a tenant: 409 webhook_limit_reached)."""
    settings = services.settings
    url = str(body.url)
    check_url(
        url,
        allow_private=settings.webhook_allow_private,
        timeout=settings.webhook_timeout_seconds,
        tenant_id=principal.tenant_id,
    )
    with session_scope(services.sessions) as s:
        hook = webhooks_db.register(
            s,
            tenant_id=principal.tenant_id,
            url=url,
            box=SecretBox.from_settings(settings),
            limit=settings.max_webhooks_per_tenant,
        )
    return _created(hook)


@router.get("", response_model=list[WebhookOut])
def list_webhooks(session: SessionDep, principal: PrincipalDep) -> list[WebhookOut]:
    return [_out(h) for h in webhooks_db.list_webhooks(session, principal.tenant_id)]


@router.delete("/{webhook_id}", status_code=204, responses=errors(404))
def delete_webhook(webhook_id: str, services: ServicesDep, principal: PrincipalDep) -> None:
    """Delete an endpoint: it gets no more events, and its pending ones are not sent."""
    with session_scope(services.sessions) as s:
        webhooks_db.delete(s, tenant_id=principal.tenant_id, webhook_id=webhook_id)


@router.post("/{webhook_id}/rotate-secret", response_model=WebhookCreated, responses=errors(404))
def rotate_secret(webhook_id: str, services: ServicesDep, principal: PrincipalDep) -> WebhookCreated:
    """A new secret, shown only now. Events are signed with both the new and the previous secret (two
    `v1,` entries in webhook-signature) for FTUNE_WEBHOOK_SECRET_GRACE_SECONDS (a day), then the new only."""
    settings = services.settings
    with session_scope(services.sessions) as s:
        hook = webhooks_db.rotate(
            s,
            tenant_id=principal.tenant_id,
            webhook_id=webhook_id,
            grace_seconds=settings.webhook_secret_grace_seconds,
            box=SecretBox.from_settings(settings),
        )
    return _created(hook)


@router.get("/{webhook_id}/deliveries", response_model=Page[DeliveryOut], responses=errors(404))
def list_deliveries(
    webhook_id: str,
    session: SessionDep,
    principal: PrincipalDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    after: Annotated[str | None, Query(max_length=200, description="next_cursor of the page before")] = None,
) -> Page[DeliveryOut]:
    """The endpoint's delivery attempts, newest first."""
    webhooks_db.get_owned(session, tenant_id=principal.tenant_id, webhook_id=webhook_id)
    before = None
    if after is not None:
        if not after.isdigit() or len(after) > 18:
            raise InvalidInput("invalid pagination cursor", code="invalid_cursor", param="after")
        before = int(after)
    rows, cursor = webhooks_db.list_deliveries(session, webhook_id=webhook_id, limit=limit, before=before)
    data = [
        DeliveryOut(
            id=r.delivery.id,
            event_id=r.delivery.event_id,
            event_type=r.event_type,
            job_id=r.job_id,
            attempt=r.delivery.attempt,
            started_at=r.delivery.started_at,
            status_code=r.delivery.status_code,
            error=r.delivery.error,
        )
        for r in rows
    ]
    return Page[DeliveryOut](
        data=data, has_more=cursor is not None, next_cursor=None if cursor is None else str(cursor)
    )
