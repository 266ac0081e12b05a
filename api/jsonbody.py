"""Large JSON bodies are decoded off the event loop, one at a time per process.

FastAPI decodes a JSON body with json.loads on the event loop; 1 MiB of `[{}, {}, ...]` takes ~25 ms
there, so a tenant posting such bodies in parallel queued every other request behind them (/health
included). A route of this class decodes a body over LARGE_BODY_BYTES in a worker thread, one decode at a
time per process (json.loads holds the interpreter lock for its whole run, so two at once would only
take turns at blocking the loop), and hands the result to FastAPI, which then validates it as usual. A
body that is not valid JSON is left to FastAPI, which answers its own 422.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
from fastapi import Request, Response
from fastapi.routing import APIRoute

from api.bodylimit import LARGE_BODY_BYTES


class ThreadDecodedRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def decode_then_handle(request: Request) -> Response:
            if _is_json(request):
                body = await request.body()
                if len(body) > LARGE_BODY_BYTES:
                    await _decode_in_thread(request, body)
            return await handler(request)

        return decode_then_handle


async def _decode_in_thread(request: Request, body: bytes) -> None:
    limiter = getattr(request.app.state, "json_decoder", None)
    if limiter is None:  # made on the loop, once per app
        limiter = request.app.state.json_decoder = anyio.CapacityLimiter(1)
    # Not JSON: FastAPI decodes it again and reports the error in its own shape.
    with contextlib.suppress(ValueError, RecursionError):
        # Request.json() returns a decoded body it holds, so FastAPI does not decode it again.
        request._json = await anyio.to_thread.run_sync(json.loads, body, limiter=limiter)


def _is_json(request: Request) -> bool:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind == "application/json" or kind.endswith("+json")
