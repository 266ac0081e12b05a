"""A loopback HTTP server of images for tests of image URLs (core.image_fetch): a real server on 127.0.0.1
that serves a PNG, bytes that are no image, a file too large (declared, or streamed without a length, counting
what it got to send before the reader hung up), a picture of too many pixels, a 404 and a redirect; it
records every path asked for."""

from __future__ import annotations

import contextlib
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

STREAMED_BYTES = 128 * 2**20  # /endless sends this much unless the reader stops first


def png(width: int = 16, height: int = 12, mode: str = "RGB") -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new(mode, (width, height), (200, 10, 10) if mode == "RGB" else 1).save(buffer, format="PNG")
    return buffer.getvalue()


def noise_png(side: int) -> bytes:
    """A PNG of random pixels (it does not compress): about 3 x side^2 bytes."""
    import os

    from PIL import Image

    buffer = io.BytesIO()
    Image.frombytes("RGB", (side, side), os.urandom(3 * side * side)).save(buffer, format="PNG")
    return buffer.getvalue()


class ImageServer:
    def __init__(self) -> None:
        self.cat = png()
        self.files = {"/cat.png": self.cat, "/not-an-image.png": b"hello, I am text\n"}
        self.requests: list[str] = []
        self.streamed: int | None = None  # bytes /endless.png got to send, once it stopped
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                server.requests.append(self.path)
                server.answer(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def answer(self, h: BaseHTTPRequestHandler) -> None:
        if h.path in self.files:
            self._send(h, 200, self.files[h.path])
        elif h.path == "/wide.png":  # 4097 x 4096 one-bit pixels: a small file, too many pixels
            self._send(h, 200, png(4097, 4096, mode="1"))
        elif h.path == "/moved.png":
            h.send_response(302)
            h.send_header("Location", "/cat.png")
            h.send_header("Content-Length", "0")
            h.end_headers()
        elif h.path == "/declared-huge.png":  # says 50 MB; the reader must not wait for them
            h.send_response(200)
            h.send_header("Content-Type", "image/png")
            h.send_header("Content-Length", str(50 * 2**20))
            h.end_headers()
            self._stream(h, 50 * 2**20)
        elif h.path == "/endless.png":  # no length: read until the server closes, or the reader stops
            h.send_response(200)
            h.send_header("Content-Type", "image/png")
            h.send_header("Connection", "close")
            h.end_headers()
            self.streamed = self._stream(h, STREAMED_BYTES)
        else:
            self._send(h, 404, b"no such image\n")

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
        h.send_response(status)
        h.send_header("Content-Type", "image/png" if status == 200 else "text/plain")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        with contextlib.suppress(OSError):  # a reader that refused the length hangs up
            h.wfile.write(body)

    @staticmethod
    def _stream(h: BaseHTTPRequestHandler, total: int) -> int:
        chunk, sent = b"\x89PNG" + b"\0" * (64 * 1024 - 4), 0
        try:
            while sent < total:
                h.wfile.write(chunk)
                sent += len(chunk)
        except OSError:  # the reader hung up
            pass
        return sent

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
