"""The fair chat queue (api/chat_queue.py) on its own, on an event loop: shares, turns across tenants, the
bound on a tenant's line and its Retry-After, a client gone while it waits, the linger, the fleet's lease.
Requests are tasks awaiting `take`; a small double stands in for the broker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from api.chat_queue import CODE, FairChatQueue, Release
from core.errors import RateLimited
from models.fleet_limits import Unavailable


class Request:
    """One request of a tenant waiting its turn: `gone` makes its client go away."""

    def __init__(self, queue: FairChatQueue, tenant: str, started: list[str]) -> None:
        self.tenant, self.left = tenant, asyncio.Event()
        self.task = asyncio.ensure_future(self._run(queue, started))

    async def _run(self, queue: FairChatQueue, started: list[str]) -> Release | None:
        release = await queue.take(self.tenant, self.left.wait)
        if release is not None:
            started.append(self.tenant)
        return release

    def gone(self) -> None:
        self.left.set()

    @property
    def started(self) -> bool:
        return self.task.done() and self.task.result() is not None

    def release(self) -> None:
        release = self.task.result()
        assert release is not None
        release()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


def queue(
    running: int, shared: int | None = None, queued: int = 64, linger: float = 60.0, **kw: Any
) -> FairChatQueue:
    """Shared places, unless given: all but the one kept free, as alone."""
    shared = running - 1 if shared is None else shared
    return FairChatQueue(
        running=running, shared=shared, queued_per_tenant=queued, linger_seconds=linger, **kw
    )


def test_a_lone_tenant_runs_all_places_but_one_and_its_other_requests_wait() -> None:
    async def test() -> None:
        q, started = queue(running=4), list[str]()
        reqs = [Request(q, "a", started) for _ in range(10)]
        await settle()
        assert (q.running_of("a"), q.waiting("a")) == (3, 7)
        assert [r.started for r in reqs] == [True] * 3 + [False] * 7  # in order of arrival
        reqs[0].release()
        await settle()
        assert reqs[3].started and q.running_of("a") == 3  # the next in its line, at once

    run(test)


def test_another_tenants_request_starts_before_the_backlog_of_a_flooding_tenant() -> None:
    async def test() -> None:
        q, started = queue(running=5), list[str]()
        a = [Request(q, "a", started) for _ in range(10)]
        await settle()
        assert q.running_of("a") == 4  # alone: all but one place
        b1 = Request(q, "b", started)
        await settle()
        assert b1.started  # the free place: at once
        b2 = Request(q, "b", started)
        await settle()
        assert not b2.started and q.share() == 2  # two tenants: (5 - 1) // 2 each
        a[0].release()
        await settle()
        assert b2.started and q.running_of("a") == 3  # A is over its share: B's comes before A's backlog
        a[1].release()
        await settle()
        assert q.running_of("a") == 2 and not a[4].started  # A down to its share, not above it
        a[2].release()
        await settle()
        assert a[4].started and started == ["a"] * 4 + ["b", "b", "a"]

    run(test)


def test_while_tenants_share_the_batch_stays_small_and_a_lone_tenant_has_it_all() -> None:
    async def test() -> None:
        q, started = queue(running=32, shared=6, linger=0.2), list[str]()
        a = [Request(q, "a", started) for _ in range(40)]
        await settle()
        assert (q.share(), q.running_of("a")) == (31, 31)  # alone: every place but one
        b = Request(q, "b", started)
        await settle()
        assert b.started and q.share() == 3  # two tenants: 6 // 2 each
        for r in a[:31]:  # A's running requests end: it starts only its share again
            r.release()
            await settle()
        assert q.running_of("a") == 3 and q.waiting("a") == 6
        Request(q, "c", started)
        await settle()
        assert q.share() == 2 and q.running_of("c") == 1  # three: 6 // 3; C starts at once
        b.release()
        await asyncio.sleep(0.4)  # B forgotten: 6 // 2 again, but A's three are at that share already
        assert q.share() == 3 and q.running_of("a") == 3

    run(test)


def test_tenants_take_turns_rather_than_first_come_first_served() -> None:
    async def test() -> None:
        q, started = queue(running=11), list[str]()
        holder = [Request(q, "h", started) for _ in range(10)]
        await settle()
        Request(q, "x", started)  # the place kept free: all eleven run now
        await settle()
        waiting = [Request(q, t, started) for t in ("a", "a", "b", "b", "c", "c")]
        await settle()
        assert q.share() == 2 and not any(r.started for r in waiting)  # five tenants, (11 - 1) // 5 each
        for h in holder[:6]:  # H, over its share, gets none of the places it frees
            h.release()
            await settle()
        assert started[11:] == ["a", "b", "c", "a", "b", "c"]  # in turn: A's second behind B's and C's first

    run(test)


def test_a_full_line_is_refused_with_a_retry_after_from_the_recent_pace() -> None:
    async def test() -> None:
        now = [0.0]
        q, started = queue(running=2, queued=2, clock=lambda: now[0]), list[str]()
        first = Request(q, "a", started)
        await settle()
        now[0] += 11.0  # one request ran 11 s: the pace's running mean goes 1 s -> 3 s
        first.release()
        reqs = [Request(q, "a", started) for _ in range(3)]
        await settle()
        assert (q.running_of("a"), q.waiting("a")) == (1, 2)
        with pytest.raises(RateLimited) as refused:
            await q.take("a", asyncio.Event().wait)
        assert refused.value.code == CODE == "too_many_concurrent_requests"
        assert refused.value.retry_after == 3  # one of its requests ends every 3 s / 1 running
        other = Request(q, "b", started)
        await settle()
        assert other.started  # another tenant's line is its own
        reqs[0].release()
        await settle()
        assert reqs[1].started and q.waiting("a") == 1
        again = Request(q, "a", started)  # room in its line again: it waits its turn
        await settle()
        assert not again.task.done() and q.waiting("a") == 2
        again.gone()
        await settle()

    run(test)


def test_a_client_gone_while_waiting_leaves_the_line_at_once() -> None:
    async def test() -> None:
        q, started = queue(running=2, queued=1), list[str]()
        running = Request(q, "a", started)
        leaving = Request(q, "a", started)
        await settle()
        assert q.waiting("a") == 1
        leaving.gone()
        await settle()
        assert leaving.task.done() and leaving.task.result() is None and q.waiting("a") == 0
        staying = Request(q, "a", started)  # the place in line is free again (the bound is 1)
        await settle()
        assert q.waiting("a") == 1
        running.release()
        await settle()
        assert staying.started and started == ["a", "a"]  # the one that left never started

    run(test)


def test_a_cancelled_request_leaves_the_line_and_its_turn_goes_to_the_next() -> None:
    async def test() -> None:
        q, started = queue(running=2), list[str]()
        running = Request(q, "a", started)
        cancelled, next_one = Request(q, "a", started), Request(q, "a", started)
        await settle()
        cancelled.task.cancel()
        await settle()
        running.release()
        await settle()
        assert next_one.started and q.running_of("a") == 1 and q.waiting("a") == 0

    run(test)


def test_a_tenant_lingers_as_active_then_the_others_share_grows_back() -> None:
    async def test() -> None:
        q, started = queue(running=5, linger=0.2), list[str]()
        a = [Request(q, "a", started) for _ in range(8)]
        b = Request(q, "b", started)
        await settle()
        assert q.running_of("a") == 4 and b.started
        for r in a[:3]:
            r.release()
        b.release()  # B is done, but its next request may come at once: A stays at its share of 2
        await settle()
        assert q.running_of("a") == 2 and q.share() == 2
        await asyncio.sleep(0.4)
        assert q.share() == 4 and q.running_of("a") == 4  # B is forgotten: A runs its lone share again

    run(test)


class FleetDouble:
    """The broker's leases: `full` refuses, `down` raises Unavailable; what is held is counted."""

    def __init__(self) -> None:
        self.full = self.down = False
        self.held: dict[str, str] = {}
        self.limits: list[int] = []

    def take(self, key: str, limit: int) -> str | None:
        if self.down:
            raise Unavailable("down")
        self.limits.append(limit)
        if self.full:
            return None
        token = f"t{len(self.limits)}"
        self.held[token] = key
        return token

    def release(self, key: str, token: str) -> None:
        assert self.held.pop(token) == key


def test_the_fleet_bounds_a_tenants_requests_across_processes() -> None:
    async def test() -> None:
        fleet = FleetDouble()
        q, started = queue(running=3, queued=5, fleet=fleet), list[str]()
        reqs = [Request(q, "a", started) for _ in range(3)]
        await settle()
        assert len(fleet.held) == 3 and fleet.limits == [8] * 3  # running + waiting: 3 + 5
        fleet.full = True  # the tenant's other processes hold the rest
        with pytest.raises(RateLimited) as refused:
            await q.take("a", asyncio.Event().wait)
        assert refused.value.code == CODE and q.waiting("a") == 1
        fleet.full, fleet.down = False, True  # no broker: this process's bound decides
        extra = Request(q, "a", started)
        await settle()
        assert q.waiting("a") == 2
        fleet.down = False
        reqs[2].gone()  # waiting: leaves, its lease goes back
        extra.gone()
        await settle()
        for r in reqs[:2]:
            r.release()
        assert fleet.held == {}

    run(test)
