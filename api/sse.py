"""A job's events as server-sent events: resumable by id, kept alive, ended when the job is terminal.

Wire format (https://html.spec.whatwg.org/multipage/server-sent-events.html):
    retry: 2000                         once, first
    id: 17 / data: {event as JSON}      one per job event, in id order (the default "message" type)
    : keep-alive                        a comment when nothing was sent for sse_keepalive_seconds
    event: end / data: {"status": ...}  last, once the job is terminal and every event was sent

The explicit "end" lets an EventSource client close() instead of reconnecting to a finished job.

A stream reads the database only when its job changed: the process's one poller (api/watch.py) tells it,
so an idle stream costs no query. A tenant has at most sse_max_streams_per_tenant streams open at once in
a process (Services.streams: 429 `too_many_streams` past it); a stream's slot is freed when it ends,
however it ends (HeldStream): its job finished, its client went away, an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from api.deps import Services
from api.schemas import event_out
from core.states import TERMINAL
from models import jobs as jobs_db
from models.tables import Job

BATCH = 200
RETRY_MS = 2000


class HeldStream(StreamingResponse):
    """A stream that runs `finish` when it ends, however it ends (done, client gone, error)."""

    def __init__(self, *args: Any, finish: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.finish = finish

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.finish()


def frame(data: Any, *, id_: int | None = None, event: str | None = None) -> str:
    lines = [f"id: {id_}"] if id_ is not None else []
    if event:
        lines.append(f"event: {event}")
    lines.append("data: " + json.dumps(data, separators=(",", ":")))
    return "\n".join(lines) + "\n\n"


def _poll(services: Services, job_id: str, after: int) -> tuple[list[str], int, str | None]:
    """New event frames after `after`, the last id, and the job's status if it is terminal and drained."""
    with services.sessions() as s:
        # Status first: finish() commits the status and its event together, so events read after a
        # terminal status include the terminal event.
        job = s.get(Job, job_id)
        if job is None:  # deleted while streaming: nothing more will come
            return [], after, "deleted"
        status = job.status
        rows, has_more = jobs_db.list_events(s, job_id, after, BATCH)
        frames = [frame(event_out(e).model_dump(mode="json"), id_=e.id) for e in rows]
    last = rows[-1].id if rows else after
    done = status if status in TERMINAL and not has_more else None
    return frames, last, done


async def event_stream(
    services: Services, job_id: str, after: int, is_disconnected: Callable[[], Awaitable[bool]]
) -> AsyncIterator[str]:
    keepalive = services.settings.sse_keepalive_seconds
    yield f"retry: {RETRY_MS}\n\n"
    last_sent = time.monotonic()
    with services.watch.following(job_id) as watch:
        while True:
            changed = watch.next_change(job_id)  # taken before the read: a change after it is not missed
            frames, after, done = await run_in_threadpool(_poll, services, job_id, after)
            for f in frames:
                yield f
            if frames:
                last_sent = time.monotonic()
            if done:
                yield frame({"status": done}, event="end")
                return
            if await is_disconnected():
                return
            if time.monotonic() - last_sent >= keepalive:
                yield ": keep-alive\n\n"
                last_sent = time.monotonic()
            if len(frames) < BATCH:  # else more are waiting: read on at once
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), last_sent + keepalive - time.monotonic())


def open_stream(
    services: Services,
    tenant_id: str,
    job_id: str,
    after: int,
    is_disconnected: Callable[[], Awaitable[bool]],
) -> HeldStream:
    """The job's events after `after` as a response that holds one of the tenant's stream slots until it
    ends; RateLimited `too_many_streams` (429) when the tenant has none left."""
    release = services.streams.take(tenant_id)

    async def finish() -> None:
        release()

    return HeldStream(
        event_stream(services, job_id, after, is_disconnected),
        media_type="text/event-stream",
        # no-transform/X-Accel-Buffering: proxies must not buffer or compress a live stream.
        headers={"Cache-Control": "no-cache, no-transform", "X-Accel-Buffering": "no"},
        finish=finish,
    )
