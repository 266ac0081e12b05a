"""Idempotency keys: claim a key for a request, finish it with the response, or release it on failure."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from core.errors import Conflict, InvalidInput
from models.db import session_scope
from models.tables import IdempotencyKey, utcnow

# A request that has been "in flight" this long died with its process; the key may be used again.
STALE_AFTER = timedelta(minutes=15)


def claim(
    sessions: sessionmaker[Session], scope: str, key: str, request_hash: str | None
) -> tuple[int, dict[str, Any]] | None:
    """Claim the key. Returns None when this request should run, or the stored (status, body) to replay.

    request_hash may be None when the body's hash is known only after it is read (uploads); then
    call `check_hash` once it is known.
    """
    try:
        with session_scope(sessions) as s:
            s.add(IdempotencyKey(scope=scope, key=key, request_hash=request_hash, status="in_flight"))
        return None
    except IntegrityError:
        pass
    with session_scope(sessions) as s:
        row = s.get(IdempotencyKey, (scope, key))
        if row is None:  # released between our insert and read: try once more
            return claim(sessions, scope, key, request_hash)
        if row.status == "in_flight":
            if utcnow() - row.created_at > STALE_AFTER and _take_over(s, scope, key, request_hash):
                return None
            raise Conflict(
                "a request with this Idempotency-Key is still in flight; retry later",
                code="idempotency_key_in_flight",
                param="Idempotency-Key",
            )
        _same_body(row, request_hash)
        assert row.response_status is not None and row.response_body is not None
        return row.response_status, row.response_body


def _take_over(s: Session, scope: str, key: str, request_hash: str | None) -> bool:
    """Compare-and-set: of the requests that read the key as stale, only the first to write it wins;
    the others find it fresh (its created_at moved) and update nothing."""
    now = utcnow()
    result = s.execute(
        update(IdempotencyKey)
        .where(
            IdempotencyKey.scope == scope,
            IdempotencyKey.key == key,
            IdempotencyKey.status == "in_flight",
            IdempotencyKey.created_at < now - STALE_AFTER,
        )
        .values(request_hash=request_hash, created_at=now)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1  # type: ignore[attr-defined]


def _same_body(row: IdempotencyKey, request_hash: str | None) -> None:
    if request_hash is not None and row.request_hash is not None and row.request_hash != request_hash:
        raise InvalidInput(
            "this Idempotency-Key was used with a different request body",
            code="idempotency_key_reused",
            param="Idempotency-Key",
        )


def stored(sessions: sessionmaker[Session], scope: str, key: str) -> IdempotencyKey | None:
    with sessions() as s:
        return s.scalar(
            select(IdempotencyKey).where(IdempotencyKey.scope == scope, IdempotencyKey.key == key)
        )


def finish(
    sessions: sessionmaker[Session], scope: str, key: str, request_hash: str | None, status: int, body: Any
) -> None:
    with session_scope(sessions) as s:
        s.execute(
            update(IdempotencyKey)
            .where(IdempotencyKey.scope == scope, IdempotencyKey.key == key)
            .values(status="done", request_hash=request_hash, response_status=status, response_body=body)
        )


def release(sessions: sessionmaker[Session], scope: str, key: str) -> None:
    """The request failed: nothing was created, so the key may be used again."""
    with session_scope(sessions) as s:
        s.execute(
            delete(IdempotencyKey).where(
                IdempotencyKey.scope == scope, IdempotencyKey.key == key, IdempotencyKey.status == "in_flight"
            )
        )
