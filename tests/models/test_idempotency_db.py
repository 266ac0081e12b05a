"""Idempotency keys on a real database: a stale in-flight key is taken over by exactly one request."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, event
from sqlalchemy.orm import Session, sessionmaker

from core.errors import Conflict
from models import idempotency as idem
from models.db import make_engine, make_session_factory, session_scope
from models.tables import IdempotencyKey, utcnow

SCOPE, KEY = "POST /jobs", "retry-1"


@pytest.fixture
def engine(migrated_url: str) -> Iterator[Engine]:
    engine = make_engine(migrated_url)
    yield engine
    engine.dispose()


def _stale_key(sessions: sessionmaker[Session]) -> None:
    """The key of a request whose process died mid-flight, long enough ago to be taken over."""
    with session_scope(sessions) as s:
        created = utcnow() - idem.STALE_AFTER - timedelta(minutes=1)
        s.add(IdempotencyKey(scope=SCOPE, key=KEY, request_hash="h0", status="in_flight", created_at=created))


def _hold_updates_until_both_read(engine: Engine) -> threading.Barrier:
    """Each thread's first UPDATE of the key waits for the other thread's: both have read the stale
    row by then, the interleaving in which a read-then-write takeover lets both win."""
    barrier = threading.Barrier(2, timeout=20)
    held: set[int] = set()

    @event.listens_for(engine, "before_cursor_execute")
    def _wait(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        me = threading.get_ident()
        if statement.startswith("UPDATE idempotency_keys") and me not in held:
            held.add(me)
            barrier.wait()

    return barrier


def test_two_requests_that_see_a_stale_key_cannot_both_take_it_over(engine: Engine) -> None:
    sessions = make_session_factory(engine)
    _stale_key(sessions)
    _hold_updates_until_both_read(engine)
    outcomes: dict[str, Any] = {}

    def request(request_hash: str) -> None:
        try:
            claimed = idem.claim(sessions, SCOPE, KEY, request_hash)
            outcomes[request_hash] = "owner" if isinstance(claimed, idem.Owner) else claimed
        except Conflict as e:
            outcomes[request_hash] = e.code
        except BaseException as e:  # reported by the assertion below
            outcomes[request_hash] = e

    threads = [threading.Thread(target=request, args=(h,)) for h in ("h1", "h2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(map(str, outcomes.values())) == ["idempotency_key_in_flight", "owner"], outcomes
    winner = next(h for h, outcome in outcomes.items() if outcome == "owner")
    row = idem.stored(sessions, SCOPE, KEY)
    assert row is not None and row.status == "in_flight" and row.request_hash == winner
    assert utcnow() - row.created_at < timedelta(minutes=1)  # fresh: not stale for the next one


def test_a_fresh_in_flight_key_is_not_taken_over(engine: Engine) -> None:
    sessions = make_session_factory(engine)
    owner = idem.claim(sessions, SCOPE, KEY, "h1")
    assert isinstance(owner, idem.Owner)
    with pytest.raises(Conflict) as e:
        idem.claim(sessions, SCOPE, KEY, "h1")
    assert e.value.code == "idempotency_key_in_flight"
    assert idem.finish(sessions, owner, "h1", 202, {"id": "j1"})
    assert idem.claim(sessions, SCOPE, KEY, "h1") == (202, {"id": "j1"})


def test_a_taken_over_claim_is_fenced_its_old_owner_changes_nothing(engine: Engine) -> None:
    """Claim, run past STALE_AFTER, a takeover: the first owner's release must not free the key for a third
    request, and its finish must not write over the new owner's; so the key runs exactly once more."""
    sessions = make_session_factory(engine)
    executions: list[str] = []
    old = idem.claim(sessions, SCOPE, KEY, "h1")
    assert isinstance(old, idem.Owner)
    executions.append("old")  # it runs... and runs past STALE_AFTER
    with session_scope(sessions) as s:
        row = s.get(IdempotencyKey, (SCOPE, KEY))
        assert row is not None
        row.created_at = utcnow() - idem.STALE_AFTER - timedelta(minutes=1)
    new = idem.claim(sessions, SCOPE, KEY, "h1")
    assert isinstance(new, idem.Owner) and new.token != old.token
    executions.append("new")
    assert not idem.release(sessions, old)  # the old owner failed late: nothing released
    with pytest.raises(Conflict):  # a third request finds the key still in flight, not free to run
        idem.claim(sessions, SCOPE, KEY, "h1")
    assert not idem.finish(sessions, old, "h1", 202, {"id": "old"})  # nor does its late answer count
    row = idem.stored(sessions, SCOPE, KEY)
    assert row is not None and row.status == "in_flight"
    assert idem.finish(sessions, new, "h1", 202, {"id": "new"})
    assert not idem.release(sessions, new)  # finished: a release after it keeps the answer
    assert idem.claim(sessions, SCOPE, KEY, "h1") == (202, {"id": "new"})
    assert executions == ["old", "new"]
