"""One poller for every job whose events this API process streams (api/sse.py).

Each tick it reads, in one query, every followed job's status and last event id, and wakes the streams of
the jobs that changed; a stream reads its new events only then. So an idle stream costs no query and no
thread, only a task waiting on an asyncio.Event: before, each stream polled the database itself every
tick, and 300 idle streams kept the API's threads and a CPU core busy.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from models import jobs as jobs_db

log = logging.getLogger(__name__)
CHUNK = 500  # job ids per query, well under any database's limit on bound parameters
Mark = tuple[str, int | None] | None  # (status, last event id); None: the job is gone


class _Poller:
    """The followed jobs of one event loop, and the task that polls them while any is followed."""

    def __init__(self, sessions: sessionmaker[Session], interval: float) -> None:
        self.sessions, self.interval = sessions, interval
        self.followers: Counter[str] = Counter()
        self.marks: dict[str, Mark] = {}
        self.changed: dict[str, asyncio.Event] = {}
        self.task: asyncio.Task[None] | None = None

    def follow(self, job_id: str) -> None:
        self.followers[job_id] += 1
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())

    def unfollow(self, job_id: str) -> None:
        self.followers[job_id] -= 1
        if self.followers[job_id] <= 0:
            del self.followers[job_id]
            self.marks.pop(job_id, None)
            self.changed.pop(job_id, None)

    def next_change(self, job_id: str) -> asyncio.Event:
        return self.changed.setdefault(job_id, asyncio.Event())

    async def _run(self) -> None:
        while self.followers:  # checked with no await before the task ends: follow() starts another
            ids = list(self.followers)
            try:
                marks = await run_in_threadpool(self._read, ids)
            except Exception:
                log.exception("reading the streamed jobs' marks failed; reading again next tick")
            else:
                for job_id in ids:
                    mark = marks.get(job_id)
                    # A job seen for the first time wakes too: its streams may have read before this mark.
                    if job_id in self.followers and (job_id not in self.marks or self.marks[job_id] != mark):
                        self.marks[job_id] = mark
                        event = self.changed.pop(job_id, None)
                        if event is not None:
                            event.set()
            await asyncio.sleep(self.interval)
        self.task = None

    def _read(self, ids: list[str]) -> dict[str, tuple[str, int | None]]:
        with self.sessions() as s:
            marks: dict[str, tuple[str, int | None]] = {}
            for i in range(0, len(ids), CHUNK):
                marks |= jobs_db.stream_marks(s, ids[i : i + CHUNK])
            return marks


class JobWatch:
    """The pollers of this process, one per event loop (the server's one; a test client may run more)."""

    def __init__(self, sessions: sessionmaker[Session], interval: float) -> None:
        self.sessions, self.interval = sessions, interval
        self._pollers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Poller] = (
            weakref.WeakKeyDictionary()
        )

    @contextmanager
    def following(self, job_id: str) -> Iterator[_Poller]:
        """While the block runs, the job is polled; `next_change(job_id)` is an event set at its next
        change. Take it before reading the job's events, so a change after that read is not missed."""
        loop = asyncio.get_running_loop()
        poller = self._pollers.get(loop)
        if poller is None:
            poller = self._pollers[loop] = _Poller(self.sessions, self.interval)
        poller.follow(job_id)
        try:
            yield poller
        finally:
            poller.unfollow(job_id)
