"""One HTTP/1.1 exchange with a tenant's server at an address already checked (core.net.checked_address):
webhook deliveries (worker/webhooks.py) and image fetches (core.image_fetch).

The connection goes to the checked address, never to a new lookup of the host (so DNS rebinding cannot swap
it); the Host header, and over TLS the SNI and the certificate check, name the host. One deadline covers the
connect, the TLS handshake, the send and every read, and at most `max_bytes` are read from the socket in all
(head and body): a server that trickles or floods holds a thread for the deadline at most. Redirects are
never followed here: the caller reads the status.
"""

from __future__ import annotations

import functools
import http.client
import io
import socket
import ssl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from core import net


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the attempt's deadline passed")
        return left


class ResponseTooLarge(http.client.HTTPException):
    pass


class _Budgeted(io.RawIOBase):
    """The read side of a connection: each read waits at most what is left of the deadline, and at most
    `limit` bytes are read in all."""

    def __init__(self, sock: socket.socket, deadline: Deadline, limit: int) -> None:
        self.sock, self.deadline, self.limit, self.left_bytes = sock, deadline, limit, limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.left_bytes <= 0:
            raise ResponseTooLarge(f"the response is over {self.limit} bytes")
        self.sock.settimeout(self.deadline.left())
        n = self.sock.recv_into(memoryview(buffer).cast("B")[: self.left_bytes])
        self.left_bytes -= n
        return n


class _Reader:
    """What http.client.HTTPResponse reads a response from: the connection's socket, budgeted."""

    def __init__(self, sock: socket.socket, deadline: Deadline, limit: int) -> None:
        self.raw = _Budgeted(sock, deadline, limit)

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(self.raw)


class PinnedConnection(http.client.HTTPConnection):
    """HTTP/1.1 to `address` (checked) speaking to `host`: the Host header, and over TLS the SNI and the
    certificate check, name the host. Each blocking step waits at most what is left of `deadline`."""

    def __init__(
        self, host: str, port: int, address: str, deadline: Deadline, tls: ssl.SSLContext | None
    ) -> None:
        super().__init__(host, port, timeout=deadline.left())
        self.address, self.deadline, self.tls = address, deadline, tls

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), timeout=self.deadline.left())
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock.settimeout(self.deadline.left())  # the handshake: one deadline for all of it
                sock = self.tls.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def send(self, data: Any) -> None:
        if self.sock is None:
            self.connect()
        assert self.sock is not None
        self.sock.settimeout(self.deadline.left())  # sendall: one deadline for all of it
        super().send(data)


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


@contextmanager
def exchange(
    method: str,
    url: str,
    address: str,
    *,
    deadline: Deadline,
    max_bytes: int,
    headers: dict[str, str],
    body: bytes | None = None,
) -> Iterator[http.client.HTTPResponse]:
    """Send one request for `url` to `address` and yield the response, its head read (at most `max_bytes`
    read from the socket in all, ResponseTooLarge past them; TimeoutError past `deadline`). The connection
    is closed when the block ends."""
    parts = urlsplit(url)
    host, port = net.host_port(url)
    tls = _tls() if parts.scheme == "https" else None
    conn = PinnedConnection(host, port, address, deadline, tls)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request(method, target, body=body, headers={**headers, "connection": "close"})
        assert conn.sock is not None
        reader: Any = _Reader(conn.sock, deadline, max_bytes)
        response = http.client.HTTPResponse(reader, method=method)
        try:
            response.begin()
            yield response
        finally:
            response.close()
    finally:
        conn.close()
