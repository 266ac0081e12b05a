"""Webhook delivery: send due outbox events, signed as Standard Webhooks, and record every attempt.

Headers: webhook-id (the event id, the same on every retry, so a receiver can drop a repeat),
webhook-timestamp (unix seconds of this attempt) and webhook-signature `v1,<base64 HMAC-SHA256 of
"<id>.<timestamp>.<body>">` keyed by the secret's base64-decoded bytes after `whsec_` (after a rotation, one
such entry per secret still valid, separated by a space). Any 2xx delivers; anything else (an error status,
the deadline, a refused connection or destination) is retried with exponential backoff from the outbox, so a
restarted worker (or another one) carries on where this one stopped.

A receiver is a tenant's server, so it is not trusted: each attempt has one hard deadline for the lookup,
connect, send and read (FTUNE_WEBHOOK_TIMEOUT_SECONDS) and reads at most MAX_RESPONSE_BYTES; the host is
resolved (a tenant's lookups bounded: core.net) and checked again at delivery and the connection made to
the address checked (core.pinned_http: the Host header, SNI and the certificate name the host); redirects
are not followed.
Attempts run in a `Deliverer`'s bounded pool, apart from the worker's heartbeat and reaper, at most so
many at once per tenant and per host. Tenants take turns (models.webhooks.due): a pass reads at most a
tenant's cap of its oldest due events, every tenant's first before anyone's second, so one tenant's
backlog neither hides another's event nor leaves threads idle that other tenants' events could use.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import http.client
import json
import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from urllib.parse import urlsplit

from sqlalchemy.orm import Session, sessionmaker

from core import net
from core.pinned_http import Deadline, exchange
from core.secretbox import SecretBox, SecretUnreadable
from core.settings import Settings
from models import webhooks as webhooks_db
from models.db import session_scope
from models.tables import utcnow

log = logging.getLogger(__name__)
MAX_BACKOFF_SECONDS = 3600.0
MAX_RESPONSE_BYTES = 64 * 1024  # the status line and headers must fit; the body is not read
DUE_PER_PASS = 200
# url, the address checked for it, body, headers, deadline in seconds -> the response's status code
Post = Callable[[str, str, bytes, dict[str, str], float], int]
# What an attempt that reached no answer raises: recorded, retried.
FAILURES = (OSError, http.client.HTTPException, ValueError)


def sign(secret: str, event_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{event_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def http_post(
    url: str,
    address: str,
    body: bytes,
    headers: dict[str, str],
    timeout: float,
    max_response_bytes: int = MAX_RESPONSE_BYTES,
) -> int:
    """POST `body` to `url` at `address`, all within `timeout` seconds (TimeoutError past it): the status code
    of the answer, whose head is read up to `max_response_bytes` and whose body is not read. No redirects: a
    signed event goes to the registered URL only."""
    deadline = Deadline(timeout)
    with exchange(
        "POST", url, address, deadline=deadline, max_bytes=max_response_bytes, headers=headers, body=body
    ) as response:
        return response.status


def backoff(settings: Settings, attempt: int) -> float:
    return float(min(settings.webhook_backoff_seconds * 2 ** (attempt - 1), MAX_BACKOFF_SECONDS))


class Deliverer:
    """Delivers due events in a pool of `webhook_concurrency` threads of its own: a receiver that stalls holds
    one thread for at most the deadline, and nothing else of the worker (the heartbeat, the reaper) waits on
    it. At most `webhook_max_in_flight_per_tenant` attempts per tenant and `..._per_host` per destination
    host run at once in this process, so one tenant cannot hold every thread; the rest wait for a later pass.

    `poke()` starts passes in the background and returns at once (the worker's tick); each attempt they
    start pokes again as it ends, so a freed thread takes the next due event without waiting for a tick.
    `run_pass()` makes one pass and waits for its attempts (the ftune.deliver_webhooks task, tests)."""

    def __init__(self, sessions: sessionmaker[Session], settings: Settings, post: Post = http_post) -> None:
        self.sessions, self.settings, self.post = sessions, settings, post
        self.pool = ThreadPoolExecutor(settings.webhook_concurrency, thread_name_prefix="ftune-webhook")
        self._dispatcher = ThreadPoolExecutor(1, thread_name_prefix="ftune-webhook-dispatch")
        self._passing = threading.Lock()  # one scheduling pass at a time
        self._lock = threading.Lock()  # the in-flight counts, the poke flags
        self._poked = self._dispatching = False
        self._in_flight = 0
        self._tenants: Counter[str] = Counter()
        self._hosts: Counter[str] = Counter()

    @functools.cached_property
    def box(self) -> SecretBox:
        return SecretBox.from_settings(self.settings)  # on first use: the key file is made then, if ever

    def poke(self) -> None:
        """Schedule the due events in the background; never blocks. A poke during a pass makes one more
        pass after it (that pass may have read the due events before this poke's freed thread)."""
        with self._lock:
            self._poked = True
            if self._dispatching:
                return
            self._dispatching = True
        try:
            self._dispatcher.submit(self._background_passes)
        except RuntimeError:  # shut down
            with self._lock:
                self._dispatching = False

    def run_pass(self) -> int:
        """One pass: attempt every due event once (within the limits); returns how many were delivered."""
        with self._passing:
            futures = self._schedule(refill=False)
        return sum(f.result() for f in futures)

    def close(self, wait: bool = False) -> None:
        """No new attempts; those in flight end by their deadline (`wait`: and are waited for)."""
        self._dispatcher.shutdown(wait=wait, cancel_futures=True)
        self.pool.shutdown(wait=wait, cancel_futures=True)

    def _background_passes(self) -> None:
        """Passes until no poke came in during the last one."""
        while True:
            with self._lock:
                if not self._poked:
                    self._dispatching = False
                    return
                self._poked = False
            try:
                with self._passing:
                    self._schedule(refill=True)
            except Exception:
                log.exception("webhook delivery pass failed")

    def _schedule(self, refill: bool) -> list[Future[bool]]:
        """Claim due events while there are free threads and the tenant and host are under their limits, and
        hand each attempt to the pool (`refill`: which pokes again when the attempt ends)."""
        settings = self.settings
        now = utcnow()
        with session_scope(self.sessions) as s:
            webhooks_db.give_up_exhausted(s, now=now, max_attempts=settings.webhook_max_attempts)
            due = webhooks_db.due(
                s,
                now=now,
                limit=DUE_PER_PASS,
                max_attempts=settings.webhook_max_attempts,
                per_tenant=settings.webhook_max_in_flight_per_tenant,
            )
        futures: list[Future[bool]] = []
        for event in due:
            host = (urlsplit(event.url).hostname or "").lower()
            if not self._reserve(event.tenant_id, host):
                if self._in_flight >= settings.webhook_concurrency:
                    break
                continue
            try:
                lease = settings.webhook_timeout_seconds + 30  # longer than an attempt can take
                with session_scope(self.sessions) as s:
                    claimed = webhooks_db.claim(
                        s,
                        event_id=event.event_id,
                        attempts=event.attempts,
                        now=utcnow(),
                        lease_seconds=lease,
                        max_attempts=settings.webhook_max_attempts,
                    )
                if claimed:
                    futures.append(self.pool.submit(self._attempt, event, host, refill))
            except BaseException:
                self._release(event.tenant_id, host)
                raise
            if not claimed:  # another worker took this attempt
                self._release(event.tenant_id, host)
        return futures

    def _reserve(self, tenant_id: str, host: str) -> bool:
        s = self.settings
        with self._lock:
            if (
                self._in_flight >= s.webhook_concurrency
                or self._tenants[tenant_id] >= s.webhook_max_in_flight_per_tenant
                or self._hosts[host] >= s.webhook_max_in_flight_per_host
            ):
                return False
            self._in_flight += 1
            self._tenants[tenant_id] += 1
            self._hosts[host] += 1
            return True

    def _release(self, tenant_id: str, host: str) -> None:
        with self._lock:
            self._in_flight -= 1
            self._tenants[tenant_id] -= 1
            self._hosts[host] -= 1

    def _attempt(self, event: webhooks_db.Due, host: str, refill: bool) -> bool:
        try:
            return self._send_and_record(event)
        except Exception:
            log.exception("webhook %s: attempt %d failed unrecorded", event.event_id, event.attempts + 1)
            return False
        finally:
            self._release(event.tenant_id, host)
            if refill:
                self.poke()  # this thread is free: the next due event need not wait for a tick

    def _send_and_record(self, event: webhooks_db.Due) -> bool:
        """Check the destination, send, record: the attempt's outcome. True if delivered."""
        settings, event_id, attempt = self.settings, event.event_id, event.attempts + 1
        started = utcnow()
        deadline = Deadline(settings.webhook_timeout_seconds)  # the lookup's, the connection's, the answer's
        status: int | None = None
        error: str | None = None
        gone = False
        try:
            with self.sessions() as s:
                url, secrets, payload = webhooks_db.target(s, event_id, box=self.box)
            address = net.checked_address(
                url,
                allow_private=settings.webhook_allow_private,
                timeout=deadline.left(),
                owner=event.tenant_id,
            )
        except webhooks_db.WebhookGone as e:
            error, gone = f"deleted: {e}", True
        except SecretUnreadable as e:
            error = f"secret_unreadable: {e}"
        except net.AddressRefused as e:
            error = f"refused: {e.reason}"  # not sent
        except OSError as e:
            error = f"unresolved: {type(e).__name__}: {e}"
        else:
            timestamp = int(started.timestamp())
            body = json.dumps(payload, separators=(",", ":")).encode()
            headers = {
                "content-type": "application/json",
                "user-agent": "ftune-webhooks",
                "webhook-id": event_id,
                "webhook-timestamp": str(timestamp),
                "webhook-signature": " ".join(sign(k, event_id, timestamp, body) for k in secrets),
            }
            try:
                status = self.post(url, address, body, headers, deadline.left())
            except FAILURES as e:
                error = f"{type(e).__name__}: {e}"
        ok = status is not None and 200 <= status < 300
        retry_at = None
        if not ok and not gone and attempt < settings.webhook_max_attempts:
            retry_at = utcnow() + timedelta(seconds=backoff(settings, attempt))
        with session_scope(self.sessions) as s:
            webhooks_db.record_attempt(
                s,
                event_id=event_id,
                attempt=attempt,
                started_at=started,
                status_code=status,
                error=error[:2000] if error else None,
                retry_at=retry_at,
            )
        if not ok:
            log.info(
                "webhook %s attempt %d failed (%s); retry at %s", event_id, attempt, status or error, retry_at
            )
        return ok


def deliver_due(sessions: sessionmaker[Session], settings: Settings, post: Post = http_post) -> int:
    """One pass with a pool of its own: attempt every due event once; returns how many were delivered."""
    deliverer = Deliverer(sessions, settings, post)
    try:
        return deliverer.run_pass()
    finally:
        deliverer.close()
