"""Back-pressure: a bounded line of requests in front of the one generation thread, which runs them.

torch runs on a single worker thread, so the event loop never blocks and the model is never entered by two
requests at once. The thread loops: offer the waiting requests, in order, to its executor (`admit`: start
it now, or not yet), then let the executor take one `step`. The batched executor (inference.batcher)
decodes every started request one token per step, so requests join and leave a running batch; `RunToEnd`
runs one request start to end (the engine before batching: `--sequential`, and plain callables).

At most `max_waiting` requests wait to start (not counting those running); one more is refused at once
(429 engine_overloaded, with Retry-After) rather than queued without bound. A request that has not
started within `timeout_seconds` is withdrawn (504 engine_timeout); the thread skips it. Work reports back
to the event loop through `Ticket.emit` (thread-safe), so a stream sends tokens as they are produced.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from inference.errors import EngineError

DONE = object()  # the last event of a ticket
log = logging.getLogger("ftune.inference")


@dataclass
class Ticket:
    """One request's place in line: `started` once the thread takes it, then its events, then DONE."""

    work: Any  # what the executor runs: a callable(ticket) for RunToEnd, a batcher.Request for Batcher
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)
    state: str = "waiting"  # waiting -> running | withdrawn (under the scheduler's lock)

    def emit(self, event: Any) -> None:
        """From the generation thread: hand an event to the request's coroutine."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Outbox:
    """Events for many tickets, handed over in one call per event loop when flushed: one wake-up of the
    loop per decoding step rather than one per token and row (the two threads share the GIL)."""

    def __init__(self) -> None:
        self._items: list[tuple[Ticket, Any]] = []

    def put(self, ticket: Ticket, event: Any) -> None:
        self._items.append((ticket, event))

    def flush(self) -> None:
        items, self._items = self._items, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Ticket, Any]]] = {}
        for ticket, event in items:
            by_loop.setdefault(ticket.loop, []).append((ticket, event))
        for loop, pairs in by_loop.items():
            loop.call_soon_threadsafe(_deliver, pairs)


def _deliver(pairs: list[tuple[Ticket, Any]]) -> None:
    for ticket, event in pairs:
        ticket.events.put_nowait(event)


class Executor(Protocol):
    """What the generation thread drives."""

    @property
    def busy(self) -> bool: ...  # started work remains: keep stepping

    def admit(self, ticket: Ticket) -> bool: ...  # start it now (True) or leave it waiting (False)

    def step(self) -> None: ...

    def abort(self, error: EngineError) -> None: ...  # a step failed: fail what was started


class RunToEnd:
    """One request at a time, start to end: `work(ticket)`'s return value is its ("result", value) event."""

    def __init__(self) -> None:
        self._ticket: Ticket | None = None

    @property
    def busy(self) -> bool:
        return self._ticket is not None

    def admit(self, ticket: Ticket) -> bool:
        if self._ticket is not None:
            return False
        self._ticket = ticket
        return True

    def step(self) -> None:
        ticket, self._ticket = self._ticket, None
        if ticket is not None:
            try:
                ticket.emit(("result", ticket.work(ticket)))
            except EngineError as e:
                ticket.emit(("error", e))
            except Exception as e:  # a bug or a broken model file: this request fails, the engine goes on
                log.exception("request failed in the engine")
                ticket.emit(("error", _internal(e)))
            ticket.emit(DONE)

    def abort(self, error: EngineError) -> None:
        self._ticket = None


def _internal(e: Exception) -> EngineError:
    return EngineError(500, "engine_error", f"{type(e).__name__}: {e}")


class Scheduler:
    def __init__(
        self, max_waiting: int = 32, timeout_seconds: float = 120.0, executor: Executor | None = None
    ) -> None:
        self.max_waiting = max_waiting
        self.timeout_seconds = timeout_seconds
        self.executor: Executor = executor or RunToEnd()
        self._line: queue.Queue[Ticket | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._thread = threading.Thread(target=self._run, name="ftune-generation", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._waiting

    def submit(self, work: Any) -> Ticket:
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
        waiting: deque[Ticket] = deque()  # taken off the line, not started yet (in order)
        while True:
            idle = not self.executor.busy
            try:  # block only when there is nothing to do
                ticket = (
                    self._line.get(timeout=0.05 if waiting else None) if idle else self._line.get_nowait()
                )
                while True:
                    if ticket is None:
                        return
                    waiting.append(ticket)
                    ticket = self._line.get_nowait()
            except queue.Empty:
                pass
            self._admit(waiting)
            if self.executor.busy:
                try:
                    self.executor.step()
                except Exception as e:  # a bug: the started requests fail, the engine goes on
                    log.exception("a generation step failed")
                    self.executor.abort(_internal(e))

    def _admit(self, waiting: deque[Ticket]) -> None:
        """Start waiting tickets in order while the executor takes them (the first it refuses blocks the
        rest: first come, first served)."""
        while waiting:
            ticket = waiting[0]
            if ticket.state != "waiting":  # withdrawn
                waiting.popleft()
                continue
            try:
                if not self.executor.admit(ticket):
                    return
            except EngineError as e:
                ticket.emit(("error", e))
                ticket.emit(DONE)
            except Exception as e:  # a broken model file, a bug: this request fails
                log.exception("request failed in the engine")
                ticket.emit(("error", _internal(e)))
                ticket.emit(DONE)
            waiting.popleft()
            with self._lock:
                if ticket.state == "waiting":
                    ticket.state = "running"
                    self._waiting -= 1
            ticket.loop.call_soon_threadsafe(ticket.started.set)
