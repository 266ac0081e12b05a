"""Counts that bound a tenant across every API process, kept in the broker (Redis or the embedded one).

Each API process used to count a tenant's holds (uploads streaming, chats, measurements, grader runs) and
its request rate on its own, so N replicas let a tenant have N times its bound. Here a hold is a lease in a
sorted set per key (member: a random token, score: its expiry in the server's milliseconds): taking one
drops the expired, counts the rest and adds a lease, in one script, so two processes cannot both take the
last place. A process renews the leases it holds every RENEW_SECONDS, so a lease outlives its holder only
when the holder died, and then by LEASE_SECONDS at most. The request rate is a token bucket per key, in a
hash, updated by one script. Both scripts read the clock of the server, never of the hosts.

Where the broker cannot be reached a call raises Unavailable and the caller counts in its own process
(the bounds of before); the broker is then left alone for RETRY_SECONDS, so an outage costs one timeout.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

log = logging.getLogger(__name__)

LEASE_SECONDS = 60.0
RENEW_SECONDS = 20.0
RETRY_SECONDS = 10.0
TIMEOUT_SECONDS = 0.5  # a call is made inside a request: an unreachable broker must not hold it long

# KEYS[1]: the key's leases. ARGV: limit, lease ms, token. 1 taken, 0 full.
TAKE = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[2]))
return 1
"""

# KEYS: leases' keys; ARGV[1]: lease ms, ARGV[1 + i]: the token held under KEYS[i]. Only leases still
# there are renewed (XX): one counted out (its expiry passed while the broker was away) stays out.
RENEW = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', now + tonumber(ARGV[1]), ARGV[i + 1])
  redis.call('PEXPIRE', key, 2 * tonumber(ARGV[1]))
end
return #KEYS
"""

# KEYS[1]: the bucket. ARGV: capacity, refill per second. Returns 0 (a token spent) or the ms to wait.
SPEND = """
local t = redis.call('TIME')
local now = t[1] + t[2] / 1000000
local capacity, rate = tonumber(ARGV[1]), tonumber(ARGV[2])
local held = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(held[1]) or capacity
local at = tonumber(held[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - at) * rate)
local wait = 0
if tokens < 1 then wait = math.ceil((1 - tokens) / rate * 1000) else tokens = tokens - 1 end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens), 'at', string.format('%.6f', now))
redis.call('PEXPIRE', KEYS[1], math.ceil(capacity / rate * 1000) + 1000)
return wait
"""


class Unavailable(Exception):
    """The broker could not be asked (now, or within RETRY_SECONDS of a failure)."""


class FleetCounters:
    """Leases and token buckets in the broker at `url`, shared by every process that names it. Building
    one connects to nothing: the first call does."""

    def __init__(
        self,
        url: str,
        *,
        lease_seconds: float = LEASE_SECONDS,
        renew_seconds: float = RENEW_SECONDS,
        retry_seconds: float = RETRY_SECONDS,
    ) -> None:
        self.lease_ms = int(lease_seconds * 1000)
        self.renew_seconds, self.retry_seconds = renew_seconds, retry_seconds
        self._client = redis.Redis.from_url(
            url, socket_connect_timeout=TIMEOUT_SECONDS, socket_timeout=TIMEOUT_SECONDS
        )
        self._take = self._client.register_script(TAKE)
        self._renew = self._client.register_script(RENEW)
        self._spend = self._client.register_script(SPEND)
        self._lock = threading.Lock()
        self._held: dict[str, str] = {}  # token -> key: the leases this process renews
        self._renewer: threading.Thread | None = None
        self._down_until = 0.0  # monotonic time before which the broker is not asked

    def take(self, key: str, limit: int) -> str | None:
        """A lease on one of `key`'s `limit` places (its token), or None when all are held."""
        token = secrets.token_hex(8)
        if not self._call(lambda: self._take(keys=[key], args=[limit, self.lease_ms, token])):
            return None
        with self._lock:
            self._held[token] = key
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew_held, name="fleet-leases", daemon=True)
                self._renewer.start()
        return token

    def release(self, key: str, token: str) -> None:
        """Give a lease back (at once; one the broker cannot be told of lapses within lease_seconds)."""
        with self._lock:
            self._held.pop(token, None)
        with contextlib.suppress(Unavailable):
            self._call(lambda: self._client.zrem(key, token))

    def spend(self, key: str, capacity: float, per_second: float) -> float:
        """Spend one token of `key`'s bucket (`capacity` tokens, refilled at `per_second`): 0.0 when spent,
        else the seconds until one is there (nothing is spent)."""
        return float(self._call(lambda: self._spend(keys=[key], args=[capacity, per_second]))) / 1000

    def _call(self, call: Callable[[], Any]) -> Any:
        if time.monotonic() < self._down_until:
            raise Unavailable("the broker failed a moment ago")
        try:
            return call()
        except redis.RedisError as e:
            self._down_until = time.monotonic() + self.retry_seconds
            log.warning(
                "the broker cannot be reached for fleet-wide limits (%s): counted in this process for %.0f s",
                type(e).__name__,
                self.retry_seconds,
            )
            raise Unavailable(str(e)) from e

    def _renew_held(self) -> None:
        """Renew this process's leases until it holds none (the thread is started again by the next take)."""
        while True:
            time.sleep(self.renew_seconds)
            with self._lock:
                held = list(self._held.items())
                if not held:
                    self._renewer = None
                    return
            keys = [key for _, key in held]
            args: list[int | str] = [self.lease_ms, *(token for token, _ in held)]
            with contextlib.suppress(Unavailable):  # tried again at the next turn
                self._call(lambda: self._renew(keys=keys, args=args))  # noqa: B023  called at once
