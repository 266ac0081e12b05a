"""Who is calling: a Bearer API key -> Principal(tenant, admin). Every resource is checked against it."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.deps import ServicesDep
from core.errors import Forbidden, Unauthorized
from models.tenants import Principal, authenticate

# Declares the scheme in the OpenAPI document (the /docs "Authorize" button); the header is parsed below,
# so that every failure is our 401 in the one error shape.
bearer = HTTPBearer(auto_error=False, description="An API key from `ftune keys create --tenant NAME`.")


def get_principal(
    request: Request,
    services: ServicesDep,
    _: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)] = None,
) -> Principal:
    if services.local_principal is not None:  # FTUNE_AUTH=off
        return services.local_principal
    scheme, _space, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    with services.sessions() as s:
        principal = authenticate(s, token.strip())
    if principal is None:
        raise Unauthorized("invalid or revoked API key")
    services.rate_limiter.check(principal.tenant_id)
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def require_admin(principal: PrincipalDep) -> Principal:
    if not principal.is_admin:
        raise Forbidden("this endpoint needs an admin key")
    return principal


AdminDep = Annotated[Principal, Depends(require_admin)]


def scope(principal: Principal) -> str | None:
    """The tenant to filter by: None (everything) for an admin."""
    return None if principal.is_admin else principal.tenant_id
