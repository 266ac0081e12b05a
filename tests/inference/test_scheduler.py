"""The bounded line in front of the generation thread, with work that blocks until released (no model)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from inference.errors import EngineError
from inference.scheduler import DONE, Scheduler, Ticket


async def events_of(ticket: Ticket) -> list:
    out = []
    while (event := await ticket.events.get()) is not DONE:
        out.append(event)
    return out


def test_overload_timeout_and_order() -> None:
    async def scenario() -> None:
        scheduler = Scheduler(max_waiting=2, timeout_seconds=0.3)
        release = threading.Event()
        ran: list[str] = []

        def blocking(ticket: Ticket) -> str:
            release.wait(5)
            ran.append("first")
            return "first"

        def quick(name: str):
            def work(ticket: Ticket) -> str:
                ran.append(name)
                return name

            return work

        first = scheduler.submit(blocking)
        await scheduler.wait_start(first)
        assert scheduler.waiting == 0
        second, third = scheduler.submit(quick("second")), scheduler.submit(quick("third"))
        assert scheduler.waiting == 2
        with pytest.raises(EngineError) as full:
            scheduler.submit(quick("fourth"))
        assert (full.value.status, full.value.code, full.value.retry_after) == (429, "engine_overloaded", 1)

        with pytest.raises(EngineError) as late:  # the thread is still busy with the first
            await scheduler.wait_start(second)
        assert (late.value.status, late.value.code) == (504, "engine_timeout")
        assert scheduler.waiting == 1  # withdrawn: its place is free again
        fifth = scheduler.submit(quick("fifth"))

        release.set()
        assert await events_of(first) == [("result", "first")]
        await scheduler.wait_start(third)
        assert await events_of(third) == [("result", "third")]
        assert await events_of(fifth) == [("result", "fifth")]
        assert ran == ["first", "third", "fifth"]  # the withdrawn one never ran
        assert scheduler.waiting == 0
        scheduler.close()

    asyncio.run(scenario())


def test_errors_reach_the_request_and_the_thread_goes_on() -> None:
    async def scenario() -> None:
        scheduler = Scheduler(max_waiting=4, timeout_seconds=5)

        def refused(ticket: Ticket) -> None:
            raise EngineError(400, "invalid_value", "no", param="messages")

        def broken(ticket: Ticket) -> None:
            raise RuntimeError("boom")

        a, b = scheduler.submit(refused), scheduler.submit(broken)
        c = scheduler.submit(lambda ticket: "fine")
        (kind, error), *_ = await events_of(a)
        assert (kind, error.status, error.param) == ("error", 400, "messages")
        (kind, error), *_ = await events_of(b)
        assert (kind, error.status, error.code) == ("error", 500, "engine_error")
        assert await events_of(c) == [("result", "fine")]
        scheduler.close()

    asyncio.run(scenario())
