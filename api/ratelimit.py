"""A token bucket per tenant: in the broker, shared by every API process (models.fleet_limits), or in this
process where there is no broker or it cannot be reached."""

from __future__ import annotations

import contextlib
import math
import threading
import time

from core.errors import RateLimited
from models.fleet_limits import FleetCounters, Unavailable

CODE = "rate_limited"


class RateLimiter:
    def __init__(self, per_minute: int, fleet: FleetCounters | None = None) -> None:
        self.capacity = float(per_minute)
        self.refill_per_second = per_minute / 60.0
        self.fleet = fleet
        self.buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, last refill time)
        self.lock = threading.Lock()

    def check(self, tenant_id: str) -> None:
        """Spend one of the tenant's requests, or raise RateLimited with the seconds until one is there."""
        wait = None
        if self.fleet is not None:
            with contextlib.suppress(Unavailable):  # counted here instead
                wait = self.fleet.spend(f"ftune:rate:{tenant_id}", self.capacity, self.refill_per_second)
        if wait is None:
            wait = self._spend_here(tenant_id)
        if wait > 0:
            raise RateLimited("too many requests; slow down", retry_after=math.ceil(wait), code=CODE)

    def _spend_here(self, tenant_id: str) -> float:
        now = time.monotonic()
        with self.lock:
            tokens, last = self.buckets.get(tenant_id, (self.capacity, now))
            tokens = min(self.capacity, tokens + (now - last) * self.refill_per_second)
            if tokens < 1:
                self.buckets[tenant_id] = (tokens, now)
                return (1 - tokens) / self.refill_per_second
            self.buckets[tenant_id] = (tokens - 1, now)
            return 0.0
