"""Who is calling: a Bearer API key -> Principal(tenant, admin). Every resource is checked against it.

On /v1/chat/completions (get_chat_principal) the operator's judge key, FTUNE_GRADER_MODEL_API_KEY where the
judge of model graders is ftune's own /v1, acts for the tenant whose grader asks, named in the
grading-tenant header (graders.judge): that tenant's models, chat slots and request rate, never an
admin's. With any other key the header changes nothing."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.deps import ServicesDep
from core.errors import Forbidden, Unauthorized
from core.judge_config import GRADING_TENANT_HEADER
from core.settings import Settings
from models.tables import Tenant
from models.tenants import Principal, authenticate

# Declares the scheme in the OpenAPI document (the /docs "Authorize" button); the header is parsed below,
# so that every failure is our 401 in the one error shape.
bearer = HTTPBearer(auto_error=False, description="An API key from `ftune keys create --tenant NAME`.")


def authenticated(request: Request, services: ServicesDep) -> tuple[Principal, str]:
    """The principal of the request's key, and the key ("" with FTUNE_AUTH=off)."""
    if services.local_principal is not None:  # FTUNE_AUTH=off
        return services.local_principal, ""
    scheme, _space, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    with services.sessions() as s:
        principal = authenticate(s, token.strip())
    if principal is None:
        raise Unauthorized("invalid or revoked API key")
    return principal, token.strip()


def get_principal(
    request: Request,
    services: ServicesDep,
    _: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)] = None,
) -> Principal:
    principal, _key = authenticated(request, services)
    services.rate_limiter.check(principal.tenant_id)
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def get_chat_principal(
    request: Request,
    services: ServicesDep,
    _: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)] = None,
) -> Principal:
    """As get_principal; the judge key naming a grading tenant is that tenant (401 for one there is not)."""
    principal, key = authenticated(request, services)
    grading = request.headers.get(GRADING_TENANT_HEADER)
    if grading is not None and is_judge_key(key, services.settings):
        with services.sessions() as s:
            tenant = s.get(Tenant, grading)
            if tenant is None:
                raise Unauthorized("the judge key acts for a tenant that does not exist")
            principal = Principal(tenant.id, tenant.name, is_admin=False)
    services.rate_limiter.check(principal.tenant_id)
    return principal


ChatPrincipalDep = Annotated[Principal, Depends(get_chat_principal)]


def is_judge_key(key: str, settings: Settings) -> bool:
    judge = settings.grader_model_api_key
    return bool(key and judge) and hmac.compare_digest(key.encode(), judge.encode())


def require_admin(principal: PrincipalDep) -> Principal:
    if not principal.is_admin:
        raise Forbidden("this endpoint needs an admin key")
    return principal


AdminDep = Annotated[Principal, Depends(require_admin)]


def scope(principal: Principal) -> str | None:
    """The tenant to filter by: None (everything) for an admin."""
    return None if principal.is_admin else principal.tenant_id
