"""Real servers for the official `openai` SDK to drive.

`server`: the API alone (`python -m cli api`: uvicorn, SQLite). No worker and no broker: files need
neither, and a job created natively stays queued (unfinished).
`stack`: `ftune up` (API, embedded broker, a training worker and a CPU worker), one for the package's tests
that train, with `org` (a tenant with a webhook on a real local `receiver`), its `training_file` and a
`finished` job. Each test makes its own tenants, so the shared servers' rows never meet across tests.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import models_dir  # noqa: F401  (the demo model, built once per session)
from tests.e2e.stack import REPO, Proc, env_for, free_port, tenant_key, wait_ready

# A base model's config.json (no weights), small enough for the planner to admit a job for it.
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}
TINY |= {"intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
TINY |= {"num_key_value_heads": 4, "vocab_size": 1000}


def jsonl(*rows: object) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


ALPACA = jsonl(*({"instruction": f"Add {i} and 1.", "output": str(i + 1)} for i in range(5)))


@dataclass
class Server:
    base: str
    data_dir: Path
    database_url: str

    def key(self, tenant: str) -> str:
        return tenant_key(self.database_url, tenant)

    def tenant(self) -> tuple[openai.OpenAI, httpx.Client]:
        """A new tenant: the SDK pointed at /v1 (no retries, so a retried status shows) and a native client,
        both with the tenant's key."""
        key = self.key(f"org-{uuid.uuid4().hex[:10]}")
        sdk = openai.OpenAI(api_key=key, base_url=f"{self.base}/v1", max_retries=0, timeout=30)
        native = httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        return sdk, native


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("openai")
    (tmp / "models" / "tiny").mkdir(parents=True)
    (tmp / "models" / "tiny" / "config.json").write_text(json.dumps(TINY))
    port, database_url = free_port(), f"sqlite:///{tmp / 'ftune.db'}"
    env = env_for(tmp, tmp / "models", FTUNE_API_PORT=str(port), FTUNE_DATABASE_URL=database_url)
    subprocess.run([sys.executable, "-m", "cli", "migrate"], env=env, check=True, cwd=REPO)
    api = Proc(["api"], env, tmp / "api.log")
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _healthy(base):  # /ready would want a broker, which files do not need
            assert api.p.poll() is None and time.monotonic() < deadline, api.tail()
            time.sleep(0.2)
        yield Server(base, tmp / "data", database_url)
    finally:
        api.stop()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def tenant(server: Server) -> Iterator[tuple[openai.OpenAI, httpx.Client]]:
    sdk, native = server.tenant()
    with sdk, native:
        yield sdk, native


# -- `ftune up` for the SDK's jobs: tiny, deterministic runs of the demo model -------------------------
EXAMPLES = REPO / "examples"
STEPS = 30
# ftune's own settings as extra body fields.
TINY_RUN = {"max_steps": STEPS, "max_seq_len": 96, "lora_r": 8, "lora_dropout": 0.0}
TINY_RUN |= {"checkpoint_every_steps": 10, "keep_checkpoints": 2}
SUPERVISED: Any = {"type": "supervised", "supervised": {"hyperparameters": {"learning_rate_multiplier": 5}}}


@dataclass
class Stack:
    base: str
    database_url: str
    models_dir: Path

    def tenant(self) -> tuple[openai.OpenAI, httpx.Client, str]:
        name = f"org-{uuid.uuid4().hex[:10]}"
        key = tenant_key(self.database_url, name)
        sdk = openai.OpenAI(api_key=key, base_url=f"{self.base}/v1", max_retries=0, timeout=60)
        native = httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        return sdk, native, key


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Stack]:  # noqa: F811
    tmp = tmp_path_factory.mktemp("openai-jobs")
    port, database_url = free_port(), f"sqlite:///{tmp / 'ftune.db'}"
    env = env_for(tmp, models_dir, FTUNE_API_PORT=str(port), FTUNE_DATABASE_URL=database_url)
    env |= {"FTUNE_REAPER_INTERVAL_SECONDS": "0.5", "FTUNE_WEBHOOK_BACKOFF_SECONDS": "0.5"}  # fast retries
    env |= {"FTUNE_WEBHOOK_ALLOW_PRIVATE": "1"}  # the webhook receiver is on loopback
    up = Proc(["up"], env, tmp / "up.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, [up], timeout=180)
        yield Stack(base, database_url, models_dir)
    except BaseException:
        print(up.tail(200))
        raise
    finally:
        up.stop(signal.SIGINT, timeout=120)


class Receiver:
    """A real local HTTP server for webhooks that fails the first `fails` attempts of every webhook-id with
    a 500, and records every request (headers, body, the status it answered) and, as a receiver should, its
    signature checked on arrival (`secret`)."""

    secret = ""

    def __init__(self, fails: int, port: int = 0) -> None:
        self.received: list[tuple[dict[str, str], bytes, int]] = []
        # each request as the SDK's webhooks.unwrap read it on arrival (with `secret`), or its error
        self.unwrapped: list[Any] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    verifier = openai.OpenAI(api_key="unused", webhook_secret=receiver.secret)
                    unwrapped: Any = verifier.webhooks.unwrap(body, headers)
                except Exception as e:  # recorded, and asserted on by the test
                    unwrapped = e
                with receiver.lock:
                    seen = sum(
                        1 for h, _, _ in receiver.received if h["webhook-id"] == self.headers["webhook-id"]
                    )
                    status = 500 if seen < fails else 200
                    receiver.received.append((headers, body, status))
                    receiver.unwrapped.append(unwrapped)
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def accepted(self) -> dict[str, int]:
        """Accepted (200) deliveries per webhook-id."""
        with self.lock:
            out: dict[str, int] = {}
            for headers, _, status in self.received:
                out[headers["webhook-id"]] = out.get(headers["webhook-id"], 0) + (status == 200)
            return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="package")
def receiver() -> Iterator[Receiver]:
    r = Receiver(fails=2)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(scope="package")
def org(stack: Stack, receiver: Receiver) -> Iterator[tuple[openai.OpenAI, httpx.Client, str]]:
    """The package's main tenant, with a webhook on `receiver` before any of its jobs exists."""
    sdk, native, key = stack.tenant()
    with sdk, native:
        r = native.post("/webhooks", json={"url": receiver.url})
        assert r.status_code == 201, r.text
        receiver.secret = r.json()["secret"]
        yield sdk, native, key


@pytest.fixture(scope="package")
def training_file(org: tuple[openai.OpenAI, httpx.Client, str]) -> str:
    sdk, _, _ = org
    with (EXAMPLES / "alpaca_small.jsonl").open("rb") as f:
        file_id = sdk.files.create(file=f, purpose="fine-tune").id
    return sdk.files.wait_for_processing(file_id, poll_interval=0.2).id


def wait_for(sdk: openai.OpenAI, job_id: str, statuses: set[str], timeout: float = 300) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = sdk.fine_tuning.jobs.retrieve(job_id)
        if job.status in statuses:
            return job
        assert job.status not in {"failed", "cancelled", "succeeded"} - statuses, job
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} never reached {statuses}")


@pytest.fixture(scope="package")
def finished(org: tuple[openai.OpenAI, httpx.Client, str], training_file: str) -> Any:
    """A job made with suffix, metadata and ftune settings, retrieved until it succeeded."""
    sdk, _, _ = org
    job = sdk.fine_tuning.jobs.create(
        model="ftune-demo",
        training_file=training_file,
        suffix="demo run",
        seed=7,
        metadata={"team": "search", "run": "baseline"},
        method=SUPERVISED,
        extra_body=TINY_RUN,
    )
    assert job.status in ("validating_files", "queued")
    return wait_for(sdk, job.id, {"succeeded"})
