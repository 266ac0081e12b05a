"""ftune's inference engine and an API in front of it, as real processes, for the fair chat queue's tests
and bench/chat_fairness.py: the engine (`python -m inference.server`, its defaults) on the demo model, the
API (`ftune api`, SQLite, no broker) forwarding to it, tenants' keys, and a timed chat request."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.e2e.stack import REPO, Proc, env_for, free_port, tenant_key

ENGINE_KEY = "chat-engine-key-for-tests-and-bench"
BASE = "ftune-demo"


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    """Until GET /health answers 200 (the log's tail if the process ends or 120 s pass first)."""
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


@contextmanager
def engine_process(models_dir: Path, tmp: Path) -> Iterator[str]:
    """The engine at its defaults on the built models until the block ends; yields its URL."""
    port = free_port()
    env = env_for(tmp, models_dir, FTUNE_INFERENCE_API_KEY=ENGINE_KEY)
    log = tmp / f"engine-{port}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "inference.server", "--port", str(port)],
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class ChatAPI:
    base: str
    database_url: str

    def key(self, tenant: str) -> str:
        """A new API key of `tenant` (created if missing)."""
        return tenant_key(self.database_url, tenant)


@contextmanager
def chat_api(tmp: Path, models_dir: Path, engine_url: str, **env: str) -> Iterator[ChatAPI]:
    """`ftune api` forwarding chat completions to the engine (ignore_eos allowed, so a request generates
    exactly max_tokens), with `env`'s settings beside; until the block ends."""
    tmp.mkdir(parents=True, exist_ok=True)
    database_url = f"sqlite:///{tmp / 'ftune.db'}"
    settings = env_for(
        tmp,
        models_dir,
        FTUNE_API_PORT=str(free_port()),
        FTUNE_DATABASE_URL=database_url,
        FTUNE_INFERENCE_URL=engine_url,
        FTUNE_INFERENCE_API_KEY=ENGINE_KEY,
        FTUNE_CHAT_ALLOW_IGNORE_EOS="true",
        **env,
    )
    subprocess.run([sys.executable, "-m", "cli", "migrate"], env=settings, check=True, cwd=REPO)
    api = Proc(["api"], settings, tmp / "api.log")
    base = f"http://127.0.0.1:{settings['FTUNE_API_PORT']}"
    try:
        wait_healthy(base, api.p, tmp / "api.log")  # not /ready: no broker here, chat needs none
        yield ChatAPI(base, database_url)
    finally:
        api.stop()


@dataclass
class Answer:
    status: int
    seconds: float
    tokens: int
    retry_after: str | None
    code: str | None


async def chat(
    client: httpx.AsyncClient, api: ChatAPI, key: str, max_tokens: int, prompt: str = "hi"
) -> Answer:
    """One chat completion of exactly `max_tokens` tokens (greedy), timed from send to answer."""
    body = {
        "model": BASE,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    started = time.monotonic()
    r = await client.post(
        f"{api.base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    )
    seconds = time.monotonic() - started
    if r.status_code != 200:
        return Answer(r.status_code, seconds, 0, r.headers.get("retry-after"), r.json()["error"]["code"])
    return Answer(200, seconds, r.json()["usage"]["completion_tokens"], None, None)
