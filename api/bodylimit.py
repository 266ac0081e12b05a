"""A cap on request bodies that are read whole (JSON): FastAPI buffers them in memory before validating.

Uploads are exempt: they stream to disk under their own limits (api/upload.py).
A declared Content-Length over the cap is refused before a byte is read; a chunked body is cut off
(413) as soon as it crosses it.
"""

from __future__ import annotations

import anyio
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_body

MAX_JSON_BODY_BYTES = 1 << 20  # a job spec is a few hundred bytes
LARGE_BODY_BYTES = 64 * 1024  # past this a JSON body waits at LargeBodyGate and is decoded off the loop


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, exempt: set[tuple[str, str]]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"].rstrip("/")) in self.exempt:
            await self.app(scope, receive, send)
            return
        message = f"the request body exceeds {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            body = error_body("payload_too_large", message, details={"max_bytes": self.max_bytes})
            await JSONResponse(body, 413)(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:
                    # An HTTPException passes FastAPI's body reading as is, to the one error shape.
                    raise HTTPException(413, message)
            return msg

        await self.app(scope, limited, send)


class LargeBodyGate:
    """Requests with a large JSON body (over `threshold` bytes, or of unknown length) run `per_credential`
    at a time per credential (the Authorization header as sent) and `total` at a time in the process; the
    rest wait, unread, before their body is read.

    Why: decoding and checking 1 MiB of JSON costs the event loop ~10-30 ms. Taken one at a time that is
    harmless; a tenant posting 1 MiB bodies on 8 connections kept the loop and the interpreter lock busy
    enough that /health's p99 went from 6 to 200 ms. Gated, the tenant's own requests queue behind each
    other (its socket buffers fill and uvicorn stops reading them) and the loop's queue stays short. The
    gate is held until the response starts: what a request does after its body is read is bounded by
    the route's own limits (a grader run by its tenant's hold), so a slot is never held for long.
    """

    def __init__(
        self, app: ASGIApp, exempt: set[tuple[str, str]], threshold: int, per_credential: int, total: int
    ) -> None:
        self.app, self.exempt, self.threshold = app, exempt, threshold
        self.per_credential = per_credential
        self.total = total
        self._waiting: dict[bytes, tuple[anyio.Semaphore, int]] = {}  # credential -> (its gate, users)
        self._all: anyio.Semaphore | None = None  # made on the event loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._is_large(scope):
            await self.app(scope, receive, send)
            return
        credential = dict(scope["headers"]).get(b"authorization", b"")
        if self._all is None:
            self._all = anyio.Semaphore(self.total)
        own = self._enter(credential)
        released = False

        async def release_on_start(message: Message) -> None:
            nonlocal released
            if message["type"] == "http.response.start" and not released:
                released = True
                own.release()
                self._all.release()  # type: ignore[union-attr]
            await send(message)

        try:
            await own.acquire()
            try:
                await self._all.acquire()
            except BaseException:
                own.release()
                raise
            try:
                await self.app(scope, receive, release_on_start)
            finally:
                if not released:
                    released = True
                    own.release()
                    self._all.release()
        finally:
            self._leave(credential)

    def _is_large(self, scope: Scope) -> bool:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return False
        if (scope["method"], scope["path"].rstrip("/")) in self.exempt:
            return False
        length = dict(scope["headers"]).get(b"content-length", b"")
        return not length.isdigit() or int(length) > self.threshold

    def _enter(self, credential: bytes) -> anyio.Semaphore:
        gate, users = self._waiting.get(credential) or (anyio.Semaphore(self.per_credential), 0)
        self._waiting[credential] = (gate, users + 1)
        return gate

    def _leave(self, credential: bytes) -> None:
        gate, users = self._waiting[credential]
        if users == 1:
            del self._waiting[credential]
        else:
            self._waiting[credential] = (gate, users - 1)
