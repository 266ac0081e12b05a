"""A job's events as server-sent events: resumable by id, kept alive, ended when the job is terminal.

Wire format (https://html.spec.whatwg.org/multipage/server-sent-events.html):
    retry: 2000                         once, first
    id: 17 / data: {event as JSON}      one per job event, in id order (the default "message" type)
    : keep-alive                        a comment when nothing was sent for sse_keepalive_seconds
    event: end / data: {"status": ...}  last, once the job is terminal and every event was sent

The explicit "end" lets an EventSource client close() instead of reconnecting to a finished job.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.concurrency import run_in_threadpool

from api.deps import Services
from api.schemas import event_out
from core.states import TERMINAL
from models import jobs as jobs_db
from models.tables import Job

BATCH = 200
RETRY_MS = 2000


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
    settings = services.settings
    yield f"retry: {RETRY_MS}\n\n"
    last_sent = time.monotonic()
    while True:
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
        if time.monotonic() - last_sent >= settings.sse_keepalive_seconds:
            yield ": keep-alive\n\n"
            last_sent = time.monotonic()
        await asyncio.sleep(settings.sse_poll_seconds)
