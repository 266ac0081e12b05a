"""Tenants and their API keys."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core import keys
from core.states import TERMINAL
from core.storage import new_id
from models.tables import ApiKey, Dataset, Job, Tenant, utcnow


@dataclass(frozen=True)
class Principal:
    tenant_id: str
    tenant_name: str
    is_admin: bool


def get_or_create_tenant(session: Session, name: str) -> Tenant:
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        tenant = Tenant(id=new_id(), name=name)
        session.add(tenant)
        session.flush()
    return tenant


def create_key(session: Session, tenant_name: str, is_admin: bool = False) -> str:
    """A new key for the tenant (created if missing). The returned key is not stored anywhere."""
    tenant = get_or_create_tenant(session, tenant_name)
    key, key_id, secret_hash = keys.new_key()
    session.add(ApiKey(id=key_id, tenant_id=tenant.id, secret_hash=secret_hash, is_admin=is_admin))
    session.flush()
    return key


def ensure_key(session: Session, key: str, tenant_name: str, is_admin: bool) -> None:
    """Make a key given from outside (e.g. FTUNE_BOOTSTRAP_ADMIN_KEY) valid, storing only its hash."""
    parsed = keys.parse(key)
    if parsed is None:
        raise ValueError("a key must look like ftk_<12 hex>_<32 url-safe chars>")
    key_id, secret = parsed
    if session.get(ApiKey, key_id) is None:
        tenant = get_or_create_tenant(session, tenant_name)
        session.add(
            ApiKey(id=key_id, tenant_id=tenant.id, secret_hash=keys.hash_secret(secret), is_admin=is_admin)
        )
        session.flush()


def revoke_key(session: Session, key_or_id: str) -> bool:
    """Revoke a key, given whole or by its id (the 12 hex after ftk_). False if there is no such key."""
    parsed = keys.parse(key_or_id)
    row = session.get(ApiKey, parsed[0] if parsed else key_or_id)
    if row is None:
        return False
    if row.revoked_at is None:
        row.revoked_at = utcnow()
    return True


def authenticate(session: Session, key: str) -> Principal | None:
    parsed = keys.parse(key)
    if parsed is None:
        return None
    key_id, secret = parsed
    row = session.get(ApiKey, key_id)
    if row is None or row.revoked_at is not None or not keys.matches(secret, row.secret_hash):
        return None
    tenant = session.get(Tenant, row.tenant_id)
    assert tenant is not None
    return Principal(tenant.id, tenant.name, row.is_admin)


def active_jobs(session: Session, tenant_id: str) -> int:
    return int(
        session.scalar(
            select(func.count())
            .select_from(Job)
            .where(Job.tenant_id == tenant_id, Job.status.not_in(TERMINAL))
        )
        or 0
    )


def stored_bytes(session: Session, tenant_id: str) -> int:
    return int(
        session.scalar(
            select(func.coalesce(func.sum(Dataset.size_bytes), 0)).where(Dataset.tenant_id == tenant_id)
        )
        or 0
    )
