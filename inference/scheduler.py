"""Back-pressure: a bounded line of requests in front of the one generation thread.

torch runs on a single worker thread, so the event loop never blocks and the model is never entered by two
requests at once. At most `max_waiting` requests wait (not counting the running one); one more is refused
at once (429 engine_overloaded, with Retry-After) rather than queued without bound. A request that has not
started within `timeout_seconds` is withdrawn (504 engine_timeout); the thread skips it. Work reports back
to the event loop through `Ticket.emit` (thread-safe), so a stream sends tokens as they are produced.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inference.errors import EngineError

DONE = object()  # the last event of a ticket
log = logging.getLogger("ftune.inference")


@dataclass
class Ticket:
    """One request's place in line: `started` once the thread takes it, then its events, then DONE."""

    work: Callable[[Ticket], Any]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)
    state: str = "waiting"  # waiting -> running | withdrawn (under the scheduler's lock)

    def emit(self, event: Any) -> None:
        """From the generation thread: hand an event to the request's coroutine."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Scheduler:
    def __init__(self, max_waiting: int = 32, timeout_seconds: float = 120.0) -> None:
        self.max_waiting = max_waiting
        self.timeout_seconds = timeout_seconds
        self._line: queue.Queue[Ticket | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._thread = threading.Thread(target=self._run, name="ftune-generation", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._waiting

    def submit(self, work: Callable[[Ticket], Any]) -> Ticket:
        """Put `work` in line (call from the event loop); EngineError 429 when the line is full."""
        ticket = Ticket(work=work, loop=asyncio.get_running_loop())
        with self._lock:
            if self._waiting >= self.max_waiting:
                raise EngineError(
                    429,
                    "engine_overloaded",
                    f"the engine has {self._waiting} requests waiting (its bound); retry later",
                    retry_after=1,
                )
            self._waiting += 1
        self._line.put(ticket)
        return ticket

    async def wait_start(self, ticket: Ticket) -> None:
        """Until the thread takes the ticket; withdrawn with 504 engine_timeout after timeout_seconds."""
        try:
            await asyncio.wait_for(ticket.started.wait(), self.timeout_seconds)
        except TimeoutError:
            if self.withdraw(ticket):
                raise EngineError(
                    504,
                    "engine_timeout",
                    f"the request waited {self.timeout_seconds:g} s for the engine without starting",
                ) from None
            await ticket.started.wait()  # the thread took it just now

    def withdraw(self, ticket: Ticket) -> bool:
        """Take a waiting ticket out of line (True), or stop a running one at its next token (False)."""
        ticket.cancelled.set()
        with self._lock:
            if ticket.state != "waiting":
                return False
            ticket.state = "withdrawn"
            self._waiting -= 1
            return True

    def close(self) -> None:
        self._line.put(None)

    def _run(self) -> None:
        while (ticket := self._line.get()) is not None:
            with self._lock:
                if ticket.state != "waiting":
                    continue
                ticket.state = "running"
                self._waiting -= 1
            ticket.loop.call_soon_threadsafe(ticket.started.set)
            try:
                ticket.emit(("result", ticket.work(ticket)))
            except EngineError as e:
                ticket.emit(("error", e))
            except Exception as e:  # a bug or a broken model file: this request fails, the engine goes on
                log.exception("request failed in the engine")
                ticket.emit(("error", EngineError(500, "engine_error", f"{type(e).__name__}: {e}")))
            ticket.emit(DONE)
