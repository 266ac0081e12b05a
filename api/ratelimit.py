"""A token bucket per tenant, in this API process (each process of a fleet limits on its own)."""

from __future__ import annotations

import math
import threading
import time

from core.errors import RateLimited


class RateLimiter:
    def __init__(self, per_minute: int) -> None:
        self.capacity = float(per_minute)
        self.refill_per_second = per_minute / 60.0
        self.buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, last refill time)
        self.lock = threading.Lock()

    def check(self, tenant_id: str) -> None:
        now = time.monotonic()
        with self.lock:
            tokens, last = self.buckets.get(tenant_id, (self.capacity, now))
            tokens = min(self.capacity, tokens + (now - last) * self.refill_per_second)
            if tokens < 1:
                self.buckets[tenant_id] = (tokens, now)
                wait = math.ceil((1 - tokens) / self.refill_per_second)
                raise RateLimited("too many requests; slow down", retry_after=wait, code="rate_limited")
            self.buckets[tenant_id] = (tokens - 1, now)
