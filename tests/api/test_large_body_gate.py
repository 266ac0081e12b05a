"""LargeBodyGate: large JSON bodies run one at a time per credential and `total` at a time in all, wait
unread rather than fail, and free their slot when the response starts or the request fails."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest
from starlette.types import Receive, Scope, Send

from api.bodylimit import LargeBodyGate

BIG = b"x" * 2048


class Recorder:
    """An ASGI app that reads the body, then holds each request until told, counting who is inside."""

    def __init__(self) -> None:
        self.inside: list[str] = []
        self.most = 0
        self.go = anyio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        who = dict(scope["headers"]).get(b"authorization", b"-").decode()
        while (await receive()).get("more_body"):
            pass
        self.inside.append(who)
        self.most = max(self.most, len(self.inside))
        try:
            if scope["path"] == "/fail":
                raise RuntimeError("the route failed")
            await self.go.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
        finally:
            self.inside.remove(who)


def gate(app: Any, total: int = 4) -> LargeBodyGate:
    return LargeBodyGate(app, exempt=set(), threshold=1024, per_credential=1, total=total)


async def post(client: httpx.AsyncClient, key: str, body: bytes = BIG, path: str = "/x") -> int:
    return (await client.post(path, content=body, headers={"authorization": key})).status_code


@pytest.mark.anyio
async def test_one_credential_runs_one_large_body_at_a_time_and_others_are_not_held() -> None:
    app = Recorder()
    transport = httpx.ASGITransport(app=gate(app))
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://t") as client,
        anyio.create_task_group() as tasks,
    ):
        for _ in range(3):
            tasks.start_soon(post, client, "Bearer a")
        tasks.start_soon(post, client, "Bearer b")
        tasks.start_soon(post, client, "Bearer a", b"{}")  # small: not gated
        await anyio.sleep(0.2)
        assert sorted(app.inside) == ["Bearer a", "Bearer a", "Bearer b"]  # one large a, one small a
        app.go.set()
    assert app.inside == [] and app.most == 3


@pytest.mark.anyio
async def test_the_total_bounds_all_credentials_and_a_failed_request_frees_its_slot() -> None:
    app = Recorder()
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gate(app, total=2), raise_app_exceptions=False), base_url="http://t"
    ) as client:
        assert await post(client, "Bearer a", path="/fail") == 500
        async with anyio.create_task_group() as tasks:
            for key in ("a", "b", "c", "d"):
                tasks.start_soon(post, client, f"Bearer {key}")
            await anyio.sleep(0.2)
            assert len(app.inside) == 2
            app.go.set()
    assert app.most == 2 and app.inside == []


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
