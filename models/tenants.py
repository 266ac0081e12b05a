"""Tenants, their API keys and their quotas.

A quota decision (a job slot, stored bytes) is made in a transaction that first locks the tenant
(`lock_tenant`), so that concurrent requests of one tenant decide one after another and none of them
counts without the others' rows. Admission holds a job slot while it measures (`reserve_job_slot`):
the slot is taken before anything slow and given back, or turned into the Job row, in short
transactions; no lock is held while the data is measured. `TenantGate` bounds work of one kind at once
(uploads streaming, measurements running) per tenant, across the fleet when given its broker.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import ColumnElement, delete, func, select, update
from sqlalchemy.orm import Session

from core import keys
from core.errors import PayloadTooLarge, RateLimited
from core.states import TERMINAL
from core.storage import new_id
from models.fleet_limits import FleetCounters, Unavailable
from models.job_files import jobs_bytes
from models.tables import ApiKey, Dataset, IdempotencyKey, Job, Tenant, utcnow
from planner.job_files import Projection


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
    """What counts in the tenant's storage quota: its datasets and its jobs' files (models.job_files)."""
    datasets = session.scalar(
        select(func.coalesce(func.sum(Dataset.size_bytes), 0)).where(Dataset.tenant_id == tenant_id)
    )
    return int(datasets or 0) + jobs_bytes(session, tenant_id)


def lock_tenant(session: Session, tenant_id: str) -> None:
    """Serialise the tenant's quota decisions: other transactions that lock the same tenant wait until this
    one ends. PostgreSQL: the tenant's row, FOR UPDATE. SQLite: the database's write lock, taken by a write;
    pysqlite begins a transaction at its first write, so call this first in the transaction, and the reads
    that follow see every commit made before it."""
    if session.get_bind().dialect.name == "sqlite":
        session.execute(update(Tenant).where(Tenant.id == tenant_id).values(name=Tenant.name))
    else:
        session.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())


def check_storage_room(session: Session, tenant_id: str, size_bytes: int, quota: int) -> None:
    """Refuse storing `size_bytes` more than the tenant's quota allows (after lock_tenant, so parallel
    uploads cannot each see the same room)."""
    used = stored_bytes(session, tenant_id)
    if used + size_bytes > quota:
        raise PayloadTooLarge(
            f"storing this upload of {size_bytes} bytes would exceed the storage quota of {quota} bytes "
            f"({used} bytes are used by datasets and job files); delete datasets or finished jobs to make "
            "room",
            code="storage_quota_exceeded",
            param="file",
            details={"quota_bytes": quota, "used_bytes": used, "size_bytes": size_bytes},
        )


def check_job_files_room(session: Session, tenant_id: str, files: Projection, quota: int) -> None:
    """Refuse a job whose files (at their most: planner.job_files.project) would take the tenant past its
    storage quota, naming the fields that shrink them (after lock_tenant, as check_storage_room)."""
    used = stored_bytes(session, tenant_id)
    if used + files.total <= quota:
        return
    parts = files.breakdown()
    param = "export" if parts["merged"] > parts["checkpoints"] else "keep_checkpoints"
    merged = f", a merged model and its archive of {parts['merged']:,} bytes" if parts["merged"] else ""
    raise PayloadTooLarge(
        f"the job's files may take up to {files.total:,} bytes, which would exceed the storage quota of "
        f"{quota:,} bytes ({used:,} are used by datasets and job files): {files.checkpoints} checkpoints "
        f"of {files.checkpoint_bytes:,} bytes at once (keep_checkpoints, plus the best by eval loss and "
        f"the one being written){merged}. Lower keep_checkpoints"
        + (', set export to "adapter"' if parts["merged"] else "")
        + ", lower lora_r or lora_target_modules, or delete datasets or finished jobs to make room",
        code="storage_quota_exceeded",
        param=param,
        details={
            "quota_bytes": quota,
            "used_bytes": used,
            "job_bytes": files.total,
            "breakdown": parts,
            "checkpoint_bytes": files.checkpoint_bytes,
            "checkpoints": files.checkpoints,
        },
    )


# Job slots held by admissions in progress: rows of the claims table (models.idempotency's), one per job
# id being admitted, under a scope of their own, so they need no table of their own. A slot outlives its
# request only when its process died; then it is ignored once older than its time to live.
SLOT_SCOPE = "{tenant_id} admission"
SLOT_HELD = "in_flight"


def too_many_jobs(limit: int) -> RateLimited:
    return RateLimited(
        f"at most {limit} queued, running or paused jobs per tenant", retry_after=60, code="too_many_jobs"
    )


def _slots(tenant_id: str, ttl_seconds: float) -> tuple[ColumnElement[bool], ColumnElement[bool]]:
    return (
        IdempotencyKey.scope == SLOT_SCOPE.format(tenant_id=tenant_id),
        IdempotencyKey.created_at >= utcnow() - timedelta(seconds=ttl_seconds),
    )


def reserve_job_slot(
    session: Session, tenant_id: str, job_id: str, *, limit: int, ttl_seconds: float
) -> None:
    """Hold one of the tenant's `limit` active-job slots for `job_id` while it is admitted; raises
    RateLimited (too_many_jobs) when its active jobs and the slots held already use them all."""
    lock_tenant(session, tenant_id)
    scope = SLOT_SCOPE.format(tenant_id=tenant_id)
    cutoff = utcnow() - timedelta(seconds=ttl_seconds)
    session.execute(
        delete(IdempotencyKey).where(IdempotencyKey.scope == scope, IdempotencyKey.created_at < cutoff)
    )
    if active_jobs(session, tenant_id) + held_slots(session, tenant_id, ttl_seconds) >= limit:
        raise too_many_jobs(limit)
    session.add(IdempotencyKey(scope=scope, key=job_id, status=SLOT_HELD, created_at=utcnow()))
    session.flush()


def held_slots(session: Session, tenant_id: str, ttl_seconds: float, *, but: str | None = None) -> int:
    """Slots held by the tenant's admissions in progress (but the one of job `but`)."""
    stmt = select(func.count()).select_from(IdempotencyKey).where(*_slots(tenant_id, ttl_seconds))
    if but is not None:
        stmt = stmt.where(IdempotencyKey.key != but)
    return int(session.scalar(stmt) or 0)


def take_job_slot(session: Session, tenant_id: str, job_id: str, *, limit: int, ttl_seconds: float) -> None:
    """The admitted job's slot becomes its Job row (inserted next in this transaction): locks the tenant,
    gives the slot back and checks again that the tenant has room (a slot held past its time to live may
    have been counted out)."""
    lock_tenant(session, tenant_id)
    release_job_slot(session, tenant_id, job_id)
    if active_jobs(session, tenant_id) + held_slots(session, tenant_id, ttl_seconds, but=job_id) >= limit:
        raise too_many_jobs(limit)


def release_job_slot(session: Session, tenant_id: str, job_id: str) -> None:
    session.execute(
        delete(IdempotencyKey).where(
            IdempotencyKey.scope == SLOT_SCOPE.format(tenant_id=tenant_id), IdempotencyKey.key == job_id
        )
    )


class TenantGate:
    """At most `per_tenant` holders of one tenant at once, and `total` of all tenants (0: no total) in this
    process; past either, `hold` raises RateLimited (429, Retry-After) at once rather than queueing work.
    With `fleet` the tenant's holders are counted across every process that shares its broker (counted in
    this process while the broker cannot be reached); the total stays this process's: it protects its host."""

    def __init__(
        self,
        *,
        what: str,
        code: str,
        per_tenant: int,
        total: int = 0,
        retry_after: int = 5,
        fleet: FleetCounters | None = None,
    ) -> None:
        self.what, self.code = what, code
        self.per_tenant, self.total, self.retry_after = per_tenant, total, retry_after
        self.fleet = fleet
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()

    def take(self, tenant_id: str) -> Callable[[], None]:
        """A hold of the tenant's (RateLimited when none is left), and its release (idempotent): for a
        hold that ends elsewhere than it began, as a chat stream's does."""
        with self._lock:
            if self.total and sum(self._held.values()) >= self.total:
                raise self._refused(f"the server runs at most {self.total} {self.what} at once; retry soon")
            room = self._held[tenant_id] < self.per_tenant
            self._held[tenant_id] += 1
        key, lease = f"ftune:holds:{self.what}:{tenant_id}", None
        if self.fleet is not None:
            try:
                lease = self.fleet.take(key, self.per_tenant)
                room = lease is not None
            except Unavailable:
                pass  # this process's count decides
            except BaseException:
                self._drop(tenant_id)
                raise
        if not room:
            self._drop(tenant_id)
            raise self._refused(
                f"at most {self.per_tenant} {self.what} per tenant at once; retry when one has finished"
            )
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if released:
                    return
                released = True
            self._drop(tenant_id)
            if lease is not None and self.fleet is not None:
                self.fleet.release(key, lease)

        return release

    def _drop(self, tenant_id: str) -> None:
        with self._lock:
            self._held[tenant_id] -= 1
            if self._held[tenant_id] <= 0:
                del self._held[tenant_id]

    def _refused(self, message: str) -> RateLimited:
        return RateLimited(message, retry_after=self.retry_after, code=self.code)

    @contextmanager
    def hold(self, tenant_id: str) -> Iterator[None]:
        release = self.take(tenant_id)
        try:
            yield
        finally:
            release()
