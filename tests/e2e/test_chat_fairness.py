"""The fair chat queue on real processes: ftune's inference engine on the demo model, and `ftune api` in
front of it (tests/e2e/chat_engine.py), once at the default settings and once with small bounds
(FTUNE_CHAT_MAX_RUNNING=2: a tenant alone runs one request; FTUNE_CHAT_MAX_QUEUED_PER_TENANT=2).

At the defaults one tenant's 16 concurrent requests are all answered (they wait their turn rather than
being refused); past its line's bound a tenant's request is 429 too_many_concurrent_requests with a
Retry-After, while another tenant's request starts at once, ahead of the first tenant's line; a client
that goes away while it waits leaves the line, so its place is free for the next request. The order of
turns between tenants is tested without processes in tests/api/test_chat_queue.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.chat_engine import BASE, ChatAPI, chat, chat_api, engine_process

pytestmark = pytest.mark.slow
LONG = 600  # tokens: a request that runs for a second or more on CPU
SMALL = {"FTUNE_CHAT_MAX_RUNNING": "2", "FTUNE_CHAT_MAX_QUEUED_PER_TENANT": "2"}


@pytest.fixture(scope="module")
def apis(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ChatAPI, ChatAPI]]:
    """(the API at the defaults, the API with SMALL bounds), both in front of one engine."""
    tmp = tmp_path_factory.mktemp("chat-fairness")
    with (
        engine_process(models_dir, tmp) as url,
        chat_api(tmp / "defaults", models_dir, url) as defaults,
        chat_api(tmp / "small", models_dir, url, **SMALL) as small,
    ):
        yield defaults, small


def test_sixteen_concurrent_requests_of_one_tenant_are_all_answered_at_the_defaults(
    apis: tuple[ChatAPI, ChatAPI],
) -> None:
    api, _ = apis
    key = api.key("sixteen")

    async def sixteen() -> list[tuple[int, int]]:
        async with httpx.AsyncClient(timeout=300) as client:
            answers = await asyncio.gather(*(chat(client, api, key, 16, f"hello {i}") for i in range(16)))
        return [(a.status, a.tokens) for a in answers]

    assert asyncio.run(sixteen()) == [(200, 16)] * 16


def test_past_its_lines_bound_a_tenant_is_refused_and_another_tenant_starts_at_once(
    apis: tuple[ChatAPI, ChatAPI],
) -> None:
    _, api = apis
    a, b = api.key("a-full"), api.key("b-beside")

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            sent = [asyncio.ensure_future(chat(client, api, a, LONG)) for _ in range(6)]
            deadline = time.monotonic() + 60
            while sum(t.done() for t in sent) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # every refusal is immediate; the accepted run or wait
            refused = [t.result() for t in sent if t.done()]
            accepted = {t for t in sent if not t.done()}
            assert len(refused) == 3, [r.status for r in refused]  # one runs, two wait: the rest refused
            for r in refused:
                assert (r.status, r.code) == (429, "too_many_concurrent_requests")
                assert r.retry_after is not None and int(r.retry_after) >= 1
            other = await chat(client, api, b, 4)  # B's own line: it starts beside A's running one
            assert (other.status, other.tokens) == (200, 4)
            assert sum(not t.done() for t in accepted) >= 2, "B's request waited behind A's line"
            answers = await asyncio.gather(*accepted)
            assert [(x.status, x.tokens) for x in answers] == [(200, LONG)] * 3

    asyncio.run(scenario())


def test_a_client_that_goes_away_while_waiting_leaves_the_line(apis: tuple[ChatAPI, ChatAPI]) -> None:
    _, api = apis
    key = api.key("a-leaving")
    body = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            holder = asyncio.ensure_future(chat(client, api, key, 3 * LONG))  # runs: the others wait
            await asyncio.sleep(0.3)
            for _ in range(2):  # fill the line (bound 2), then go away
                with pytest.raises(httpx.ReadTimeout):
                    await client.post(
                        f"{api.base}/v1/chat/completions",
                        json=body,
                        headers={"Authorization": f"Bearer {key}"},
                        timeout=httpx.Timeout(30, read=0.5),
                    )
            await asyncio.sleep(0.2)
            assert not holder.done(), "the running request ended before the line was tested"
            waiting = [asyncio.ensure_future(chat(client, api, key, 4)) for _ in range(2)]
            await asyncio.sleep(0.5)
            assert not any(w.done() for w in waiting)  # they wait: the two gone left their places
            refused = await chat(client, api, key, 4)
            assert (refused.status, refused.code) == (429, "too_many_concurrent_requests")  # full again
            assert [(x.status, x.tokens) for x in await asyncio.gather(holder, *waiting)] == [
                (200, 3 * LONG),
                (200, 4),
                (200, 4),
            ]

    asyncio.run(scenario())
