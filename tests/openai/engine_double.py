"""A test double of the inference engine (the contract in docs/inference.md), and a real API pointed at it.

The double is a real HTTP server on a local port: it records the adapters ftune registers, answers chat
completions with an echo (JSON, or server-sent events for stream=true), 404s a `ft:` model it was not told
about (as an engine that restarted would), 429s a request whose last message is "overload" and 504s
"slow", so the API's forwarding and error passthrough are tested over real sockets without a model. With
`key` set it wants `Authorization: Bearer <key>` (401 otherwise), as ftune's engine with
FTUNE_INFERENCE_API_KEY does. A request whose last message is "hold" is held (counted in `holding`) until
`release` is set, or until its client drops the connection (counted in `dropped`): the API's cancellation.
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from safetensors.numpy import save_file

from core.storage import Storage
from models.db import make_engine, make_session_factory, session_scope
from models.tables import Artifact, Job
from models.tenants import create_key, get_or_create_tenant
from tests.e2e.stack import REPO, Proc, env_for, free_port
from tests.openai.conftest import TINY
from tests.rows import valid_dataset


@dataclass
class EngineDouble:
    loads: list[dict[str, Any]] = field(default_factory=list)
    chats: list[dict[str, Any]] = field(default_factory=list)
    loaded: set[str] = field(default_factory=set)
    key: str = ""
    release: threading.Event = field(default_factory=threading.Event)
    holding: int = 0  # "hold" requests waiting now
    dropped: int = 0  # "hold" requests whose client (the API) closed the connection
    lock: threading.Lock = field(default_factory=threading.Lock)

    def hold(self, conn: socket.socket) -> bool:
        """Until `release` (True) or the client closes the connection (False); 30 s at most."""
        with self.lock:
            self.holding += 1
        try:
            deadline = time.monotonic() + 30
            while not self.release.is_set() and time.monotonic() < deadline:
                readable, _, _ = select.select([conn], [], [], 0.05)
                if readable and not conn.recv(1, socket.MSG_PEEK):
                    with self.lock:
                        self.dropped += 1
                    return False
            return True
        finally:
            with self.lock:
                self.holding -= 1

    def restart(self) -> None:
        """Forget every adapter, as a restarted engine does."""
        self.loaded.clear()

    def answer(self, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
        model, last = body["model"], body["messages"][-1]["content"]
        if last == "overload":
            error = {"message": "too many requests waiting", "type": "rate_limit_error", "param": None}
            return 429, {"Retry-After": "7"}, {"error": error | {"code": "engine_overloaded"}}
        if last == "slow":
            error = {"message": "no answer within 120 s", "type": "server_error", "param": None}
            return 504, {}, {"error": error | {"code": "engine_timeout"}}
        if model.startswith("ft:") and model not in self.loaded:
            error = {"message": f"The model `{model}` does not exist.", "type": "invalid_request_error"}
            return 404, {}, {"error": error | {"param": "model", "code": "model_not_found"}}
        return 200, {}, f"echo {model}: {last}"


def completion(model: str, text: str) -> dict[str, Any]:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model} | {
        "choices": [choice],
        "usage": usage,
    }


def chunks(model: str, text: str) -> Iterator[bytes]:
    for i, word in enumerate(text.split(" ")):
        delta = {"content": word if i == 0 else " " + word}
        chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": model}
        chunk["choices"] = [{"index": 0, "delta": delta, "finish_reason": None}]
        yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def serve(engine: EngineDouble) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _refused(self) -> bool:
            if engine.key and self.headers.get("Authorization") != f"Bearer {engine.key}":
                error = {"message": "bad key", "type": "authentication_error", "param": None}
                self._json(401, {"error": error | {"code": "invalid_api_key"}})
                return True
            return False

        def do_GET(self) -> None:
            if self.path != "/health" and self._refused():
                return
            self._json(200, {"status": "ok"} if self.path == "/health" else {"object": "list", "data": []})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self._refused():
                return
            if self.path == "/v1/load_lora_adapter":
                engine.loads.append(body)
                engine.loaded.add(body["lora_name"])
                return self._json(200, {"status": "loaded"})
            engine.chats.append(body)
            if body["messages"][-1]["content"] == "hold" and not engine.hold(self.connection):
                return
            status, headers, answer = engine.answer(body)
            if status != 200:
                return self._json(status, answer, headers)
            if not body.get("stream"):
                return self._json(200, completion(body["model"], answer))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for chunk in chunks(body["model"], answer):
                self.wfile.write(chunk)
                self.wfile.flush()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@dataclass
class ChatStack:
    base: str
    data_dir: Path
    database_url: str
    engine: EngineDouble

    def tenant(self) -> tuple[openai.OpenAI, str]:
        """A new tenant: the SDK (no retries) and its tenant id."""
        name = f"org-{uuid.uuid4().hex[:10]}"
        engine = make_engine(self.database_url)
        try:
            with session_scope(make_session_factory(engine)) as s:
                key = create_key(s, name)
                tenant_id = get_or_create_tenant(s, name).id
        finally:
            engine.dispose()
        return openai.OpenAI(api_key=key, base_url=f"{self.base}/v1", max_retries=0, timeout=30), tenant_id

    def finished_job(self, tenant_id: str, status: str = "succeeded", suffix: str = "demo") -> str:
        """A job row of the tenant in this status, with an adapter directory as training leaves it."""
        job_id, ds_id = uuid.uuid4().hex, uuid.uuid4().hex
        engine = make_engine(self.database_url)
        try:
            with session_scope(make_session_factory(engine)) as s:
                s.add(valid_dataset(tenant_id, ds_id))
                s.flush()
                s.add(
                    Job(
                        id=job_id,
                        tenant_id=tenant_id,
                        status=status,
                        spec={"base_model": "tiny", "dataset_id": ds_id},
                        dataset_id=ds_id,
                        base_model="tiny",
                        method="lora",
                        suffix=suffix,
                    )
                )
        finally:
            engine.dispose()
        adapter = Storage(self.data_dir).adapter_dir(job_id)
        adapter.mkdir(parents=True)
        (adapter / "adapter_config.json").write_text("{}")
        return job_id

    def checkpoint(self, job_id: str, step: int) -> Path:
        """A checkpoint of the job as training keeps it (its trainable weights by parameter name, an Artifact
        row), and the final adapter's weights under PEFT's names; returns the checkpoint's directory."""
        storage = Storage(self.data_dir)
        weights = {
            f"base_model.model.layers.0.q_proj.lora_{x}.default.weight": np.full((2, 2), step, "f4")
            for x in "AB"
        }
        ckpt = storage.checkpoints_dir(job_id) / f"step-{step:08d}"
        ckpt.mkdir(parents=True)
        save_file(weights, str(ckpt / "adapter.safetensors"))
        final = {k.replace(".default", ""): np.zeros((2, 2), "f4") for k in weights}
        save_file(final, str(storage.adapter_dir(job_id) / "adapter_model.safetensors"))
        relpath = ckpt.relative_to(storage.job_dir(job_id)).as_posix()
        engine = make_engine(self.database_url)
        try:
            with session_scope(make_session_factory(engine)) as s:
                s.add(
                    Artifact(
                        id=uuid.uuid4().hex,
                        job_id=job_id,
                        kind="checkpoint",
                        relpath=relpath,
                        size_bytes=1,
                        sha256="0" * 64,
                        step=step,
                    )
                )
        finally:
            engine.dispose()
        return ckpt


def start_api(tmp: Path, **env_extra: str) -> tuple[Proc, str, str]:
    """A real API (`python -m cli api`, uvicorn, SQLite) with the tiny catalog model; (proc, base, db url)."""
    (tmp / "models" / "tiny").mkdir(parents=True, exist_ok=True)
    (tmp / "models" / "tiny" / "config.json").write_text(json.dumps(TINY))
    port, database_url = free_port(), f"sqlite:///{tmp / 'ftune.db'}"
    env = env_for(tmp, tmp / "models", FTUNE_API_PORT=str(port), FTUNE_DATABASE_URL=database_url, **env_extra)
    subprocess.run([sys.executable, "-m", "cli", "migrate"], env=env, check=True, cwd=REPO)
    api = Proc(["api"], env, tmp / "api.log")
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return api, base, database_url
        except httpx.HTTPError:
            pass
        assert api.p.poll() is None and time.monotonic() < deadline, api.tail()
        time.sleep(0.2)


ENGINE_KEY = "double-engine-key"


@pytest.fixture(scope="session")
def chat_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChatStack]:
    """The API (default chat limits) in front of the double, which wants ENGINE_KEY."""
    engine = EngineDouble(key=ENGINE_KEY)
    server = serve(engine)
    tmp = tmp_path_factory.mktemp("chat")
    url = f"http://127.0.0.1:{server.server_port}"
    api, base, database_url = start_api(tmp, FTUNE_INFERENCE_URL=url, FTUNE_INFERENCE_API_KEY=ENGINE_KEY)
    try:
        yield ChatStack(base, tmp / "data", database_url, engine)
    finally:
        api.stop()
        server.shutdown()
