"""A cap on request bodies that are read whole (JSON): FastAPI buffers them in memory before validating.

Uploads are exempt: they stream to disk under their own limits (api/upload.py).
A declared Content-Length over the cap is refused before a byte is read; a chunked body is cut off
(413) as soon as it crosses it.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_body

MAX_JSON_BODY_BYTES = 1 << 20  # a job spec is a few hundred bytes


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
