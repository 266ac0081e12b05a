"""A real server (`python -m cli api`: uvicorn, SQLite) for the official `openai` SDK to drive.

No worker and no broker: files need neither, and a job created natively stays queued (unfinished).
Each test makes its own tenants, so the shared server's rows never meet across tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from models.db import make_engine, make_session_factory, session_scope
from models.tenants import create_key
from tests.e2e.stack import REPO, Proc, env_for, free_port

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
        engine = make_engine(self.database_url)
        try:
            with session_scope(make_session_factory(engine)) as s:
                return create_key(s, tenant)
        finally:
            engine.dispose()

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
