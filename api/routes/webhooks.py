"""Webhooks: a tenant registers URLs for signed job events (fine_tuning.job.succeeded|failed|cancelled,
Standard Webhooks); the secret is shown once, at registration. The workers deliver (worker/webhooks.py)."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter
from pydantic import AnyHttpUrl, BaseModel, Field

from api.auth import PrincipalDep
from api.deps import ServicesDep, SessionDep
from api.responses import AUTHED, errors
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


class WebhookCreated(WebhookOut):
    secret: str = Field(description="whsec_...: verifies the webhook-signature header; shown only now.")


def _out(hook: Webhook) -> WebhookOut:
    return WebhookOut(id=hook.id, url=hook.url, created_at=hook.created_at)


@router.post("", status_code=201, response_model=WebhookCreated, responses=errors(400))
def register_webhook(body: WebhookIn, services: ServicesDep, principal: PrincipalDep) -> WebhookCreated:
    with session_scope(services.sessions) as s:
        hook = webhooks_db.register(s, tenant_id=principal.tenant_id, url=str(body.url))
        return WebhookCreated(**_out(hook).model_dump(), secret=hook.secret)


@router.get("", response_model=list[WebhookOut])
def list_webhooks(session: SessionDep, principal: PrincipalDep) -> list[WebhookOut]:
    return [_out(h) for h in webhooks_db.list_webhooks(session, principal.tenant_id)]
