"""Idempotency keys: claim a key for a request, finish it with the response, or release it on failure.

A claim is fenced: its `Owner` carries the claim's created_at as a token, which a takeover of a stale
claim moves, so `finish` and `release` change the row only while it is still that claim's. An owner
that was taken over (it ran past STALE_AFTER) can neither free the key for a third request nor write
its response over the new owner's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from core.errors import Conflict, InvalidInput
from models.db import rows_changed, session_scope
from models.tables import IdempotencyKey, utcnow

log = logging.getLogger(__name__)

# A request that has been "in flight" this long died with its process; the key may be used again.
STALE_AFTER = timedelta(minutes=15)


@dataclass(frozen=True)
class Owner:
    """This request holds the key; `token` (the claim's created_at) fences its finish and release."""

    scope: str
    key: str
    token: datetime


Replay = tuple[int, dict[str, Any]]  # the first request's (status, body)


def claim(sessions: sessionmaker[Session], scope: str, key: str, request_hash: str | None) -> Owner | Replay:
    """Claim the key. Returns an Owner when this request should run, or the stored (status, body) to replay.

    request_hash may be None when the body's hash is known only after it is read (uploads); then
    call `check_hash` once it is known.
    """
    now = utcnow()
    try:
        with session_scope(sessions) as s:
            s.add(
                IdempotencyKey(
                    scope=scope, key=key, request_hash=request_hash, status="in_flight", created_at=now
                )
            )
        return Owner(scope, key, now)
    except IntegrityError:
        pass
    with session_scope(sessions) as s:
        row = s.get(IdempotencyKey, (scope, key))
        if row is None:  # released between our insert and read: try once more
            return claim(sessions, scope, key, request_hash)
        if row.status == "in_flight":
            if utcnow() - row.created_at > STALE_AFTER:
                token = _take_over(s, scope, key, request_hash)
                if token is not None:
                    return Owner(scope, key, token)
            raise Conflict(
                "a request with this Idempotency-Key is still in flight; retry later",
                code="idempotency_key_in_flight",
                param="Idempotency-Key",
            )
        _same_body(row, request_hash)
        assert row.response_status is not None and row.response_body is not None
        return row.response_status, row.response_body


def _take_over(s: Session, scope: str, key: str, request_hash: str | None) -> datetime | None:
    """Compare-and-set: of the requests that read the key as stale, only the first to write it wins (its
    new token returned); the others find it fresh (its created_at moved) and update nothing (None)."""
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
    return now if rows_changed(result) == 1 else None


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


def _owned(owner: Owner) -> tuple[Any, ...]:
    """The row while `owner`'s claim holds it: still in flight, its token unmoved by a takeover."""
    return (
        IdempotencyKey.scope == owner.scope,
        IdempotencyKey.key == owner.key,
        IdempotencyKey.status == "in_flight",
        IdempotencyKey.created_at == owner.token,
    )


def finish(
    sessions: sessionmaker[Session], owner: Owner, request_hash: str | None, status: int, body: Any
) -> bool:
    """Store the response to replay; False (nothing stored) when the claim was taken over meanwhile."""
    with session_scope(sessions) as s:
        result = s.execute(
            update(IdempotencyKey)
            .where(*_owned(owner))
            .values(status="done", request_hash=request_hash, response_status=status, response_body=body)
            .execution_options(synchronize_session=False)
        )
    return _fenced(rows_changed(result), owner, "finish")


def release(sessions: sessionmaker[Session], owner: Owner) -> bool:
    """The request failed: nothing was created, so the key may be used again. False (nothing released)
    when the claim was taken over meanwhile."""
    with session_scope(sessions) as s:
        result = s.execute(
            delete(IdempotencyKey).where(*_owned(owner)).execution_options(synchronize_session=False)
        )
    return _fenced(rows_changed(result), owner, "release")


def _fenced(rowcount: int, owner: Owner, what: str) -> bool:
    if rowcount != 1:
        log.warning(
            "Idempotency-Key %r (%s): the claim was taken over; its %s changes nothing",
            owner.key,
            owner.scope,
            what,
        )
    return rowcount == 1
