"""A real HTTP server speaking just enough of /v1/chat/completions to stand in for a judge model."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# (request body) -> (HTTP status, response body: a dict as JSON, or raw text)
Answer = Callable[[dict[str, Any]], tuple[int, Any]]


def completion(
    content: str | None, *, refusal: str | None = None, prompt_tokens: int = 11, completion_tokens: int = 5
) -> dict[str, Any]:
    message = {"role": "assistant", "content": content, "refusal": refusal}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "judge",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


class ChatStub:
    """`answer` decides each reply; `requests` keeps what was asked (body, the Authorization header and
    the grading tenant that ftune's judge names)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.base_url = ""
        self.reset()

    def reset(self) -> None:
        self.answer: Answer = lambda body: (200, completion("1"))
        self.requests: list[dict[str, Any]] = []


@contextmanager
def chat_stub() -> Iterator[ChatStub]:
    stub = ChatStub()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with stub.lock:
                stub.requests.append(
                    {
                        "path": self.path,
                        "auth": self.headers.get("Authorization"),
                        "tenant": self.headers.get("X-Ftune-Grading-Tenant"),
                        "body": body,
                    }
                )
            status, reply = stub.answer(body) if self.path == "/v1/chat/completions" else (404, "not found")
            data = reply.encode() if isinstance(reply, str) else json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    stub.base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        yield stub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
