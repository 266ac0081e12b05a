"""A fair queue in front of the inference engine: tenants' chat completions take turns for its batch.

The engine decodes every running request together (continuous batching), so a tenant's many requests
should run side by side rather than be refused, but every row it adds slows each step of everyone's
rows. So this API process forwards at most `running` requests at once (all tenants). A tenant alone runs
all of them but one: the place kept free lets a newcomer start at once. While k > 1 tenants are active
each runs at most `shared // k` (at least 1): the batch then stays near `shared` rows, whose steps are
fast, so a tenant that floods does not slow another's requests much. The share holds even when others
leave theirs unused (it is their latency that it keeps), and a tenant stays active for `linger_seconds`
after its last request ended, so a client that sends its next request right away finds its place.

The rest wait in their tenant's line; a freed place goes to the next tenant in turn (round robin) that
is under its share, its oldest request first. A tenant with `queued_per_tenant` requests waiting is
refused (429 `too_many_concurrent_requests`), with a Retry-After from the pace at which its requests
start. A request whose client goes away while it waits leaves its line at once.

With a broker (`fleet`), a tenant's requests (running and waiting) are bounded across every API process
by `queued_per_tenant + running` (leases, models.fleet_limits); the turns and shares are each process's
own. All of it runs on the API's event loop: no lock is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from core.errors import RateLimited
from models.fleet_limits import FleetCounters, Unavailable

CODE = "too_many_concurrent_requests"
FIRST_HOLD_SECONDS = 1.0  # the pace assumed before any request has finished
PACE_WEIGHT = 0.2  # of the newest request in the running mean of how long a request runs

Release = Callable[[], None]


@dataclass
class _Line:
    """A tenant's requests: its waiting ones (futures set when their turn comes) and how many run."""

    waiting: deque[asyncio.Future[None]] = field(default_factory=deque)
    running: int = 0
    idle_since: float | None = None  # when its last request ended (it lingers as active a while)


class FairChatQueue:
    def __init__(
        self,
        *,
        running: int,
        shared: int,
        queued_per_tenant: int,
        linger_seconds: float,
        fleet: FleetCounters | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if running < 1 or shared < 1 or queued_per_tenant < 0 or linger_seconds < 0:
            raise ValueError("running, shared >= 1; queued_per_tenant, linger_seconds >= 0")
        self.running, self.shared = running, min(shared, max(1, running - 1))
        self.queued_per_tenant, self.linger_seconds = queued_per_tenant, linger_seconds
        self.fleet, self.clock = fleet, clock
        self._lines: dict[str, _Line] = {}
        self._turns: deque[str] = deque()  # tenants with requests waiting, the next to be served first
        self._hold_seconds = FIRST_HOLD_SECONDS

    # -- what tests and the log read --------------------------------------------------------------------
    def waiting(self, tenant_id: str) -> int:
        line = self._lines.get(tenant_id)
        return len(line.waiting) if line else 0

    def running_of(self, tenant_id: str) -> int:
        line = self._lines.get(tenant_id)
        return line.running if line else 0

    def share(self) -> int:
        """The most requests a tenant runs at once now."""
        active = self._active()
        return max(1, self.running - 1 if active <= 1 else self.shared // active)

    # -- a request's turn -------------------------------------------------------------------------------
    async def take(self, tenant_id: str, gone: Callable[[], Awaitable[object]]) -> Release | None:
        """Wait for the tenant's turn; its release (idempotent), or None when `gone()` returned first (the
        client went away: the request left the line). RateLimited when the tenant's line is full."""
        lease = self._lease(tenant_id)
        line = self._lines.get(tenant_id) or _Line()
        if len(line.waiting) >= self.queued_per_tenant and not self._free_for(line):
            self._unlease(tenant_id, lease)
            raise self._refused(line, f"{self.queued_per_tenant} chat requests of this tenant are waiting")
        self._lines[tenant_id] = line
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line.waiting.append(turn)
        line.idle_since = None
        if tenant_id not in self._turns:
            self._turns.append(tenant_id)
        self._dispatch()
        if not turn.done():
            watcher = asyncio.ensure_future(gone())
            either: set[asyncio.Future[Any]] = {turn, watcher}
            try:
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                self._leave(tenant_id, turn, lease)
                raise
            finally:
                watcher.cancel()
            if not turn.done() or watcher.done():
                self._leave(tenant_id, turn, lease)
                return None
        return self._release_of(tenant_id, lease)

    def _free_for(self, line: _Line) -> bool:
        """A request of this tenant would start at once (nothing waits before it)."""
        return not line.waiting and line.running < self.share() and self._running() < self.running

    def _leave(self, tenant_id: str, turn: asyncio.Future[None], lease: str | None) -> None:
        """A waiting request goes (its client went): out of its line; a turn it was given just now is
        handed back."""
        line = self._lines[tenant_id]
        if turn.done() and not turn.cancelled():
            line.running -= 1
        else:
            turn.cancel()
        with contextlib.suppress(ValueError):
            line.waiting.remove(turn)
        if not line.waiting and tenant_id in self._turns:
            self._turns.remove(tenant_id)
        self._unlease(tenant_id, lease)
        self._settle(tenant_id)
        self._dispatch()

    def _release_of(self, tenant_id: str, lease: str | None) -> Release:
        started, released = self.clock(), False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            held = max(0.0, self.clock() - started)
            self._hold_seconds += PACE_WEIGHT * (held - self._hold_seconds)
            self._lines[tenant_id].running -= 1
            self._unlease(tenant_id, lease)
            self._settle(tenant_id)
            self._dispatch()

        return release

    # -- turns ------------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Give free places to waiting requests: tenants in turn, each under its share, oldest first."""
        share = self.share()
        while self._running() < self.running:
            tenant_id = next((t for t in self._turns if self._lines[t].running < share), None)
            if tenant_id is None:
                return
            line = self._lines[tenant_id]
            turn = line.waiting.popleft()
            self._turns.remove(tenant_id)
            if line.waiting:
                self._turns.append(tenant_id)  # the back of the round
            if not turn.done():
                line.running += 1
                turn.set_result(None)

    def _settle(self, tenant_id: str) -> None:
        """A tenant with nothing left lingers as active for linger_seconds, then is forgotten; the shares
        grow back then."""
        line = self._lines.get(tenant_id)
        if line is None or line.waiting or line.running:
            return
        line.idle_since = self.clock()
        if tenant_id in self._turns:
            self._turns.remove(tenant_id)
        asyncio.get_running_loop().call_later(self.linger_seconds, self._expire, tenant_id)

    def _expire(self, tenant_id: str) -> None:
        line = self._lines.get(tenant_id)
        if line is None or line.idle_since is None:
            return  # busy again: it settles anew when it is done
        left = line.idle_since + self.linger_seconds - self.clock()
        if left > 0:  # a timer may fire a hair early
            asyncio.get_running_loop().call_later(left, self._expire, tenant_id)
            return
        del self._lines[tenant_id]
        self._dispatch()

    def _active(self) -> int:
        return len(self._lines)  # running, waiting or lingering (the rest are forgotten)

    def _running(self) -> int:
        return sum(line.running for line in self._lines.values())

    # -- bounds -----------------------------------------------------------------------------------------
    def _lease(self, tenant_id: str) -> str | None:
        """A fleet-wide place for the request (None without a broker, or while it cannot be reached)."""
        if self.fleet is None:
            return None
        limit = self.queued_per_tenant + self.running
        try:
            lease = self.fleet.take(self._key(tenant_id), limit)
        except Unavailable:
            return None  # this process's bound decides
        if lease is None:
            line = self._lines.get(tenant_id) or _Line()
            raise self._refused(line, f"{limit} chat requests of this tenant are running or waiting")
        return lease

    def _unlease(self, tenant_id: str, lease: str | None) -> None:
        if lease is not None and self.fleet is not None:
            self.fleet.release(self._key(tenant_id), lease)

    @staticmethod
    def _key(tenant_id: str) -> str:
        return f"ftune:holds:chat queue:{tenant_id}"

    def _refused(self, line: _Line, why: str) -> RateLimited:
        """429 with the seconds until a place of this tenant's frees at the recent pace: one of its running
        requests ends every hold / running seconds."""
        retry_after = max(1, math.ceil(self._hold_seconds / max(1, line.running)))
        return RateLimited(
            f"{why}, the most this server takes; retry after {retry_after} s",
            retry_after=retry_after,
            code=CODE,
        )
