"""A webhook receiver for tests of a hostile tenant: it reads the request, then answers one byte a second."""

from __future__ import annotations

import socket
import threading


class SlowLoris:
    """A loopback receiver that reads the request, then answers one byte a second, forever."""

    def __init__(self, first: bytes = b"HTTP/1.1 200 OK\r\n") -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}/hooks"
        self.first, self.sent, self.connections = first, 0, 0
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                conn.recv(65536)
                payload = self.first + b"x-slow: " + b"a" * 10_000
                for i in range(len(payload)):
                    conn.sendall(payload[i : i + 1])
                    self.sent += 1
                    if self.stop.wait(1):
                        return
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.server.close()
