"""Start the real service processes for end-to-end tests, and clean them up."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
# Provisioned as an admin key in every service the tests start (FTUNE_BOOTSTRAP_ADMIN_KEY).
TEST_ADMIN_KEY = "ftk_0123456789ab_" + "t" * 32
AUTH = {"Authorization": f"Bearer {TEST_ADMIN_KEY}"}
api = httpx.Client(headers=AUTH, timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def uvicorn_thread(app: Any, port: int | None = None) -> Iterator[str]:
    """`app` on a real uvicorn server in a thread of this process (on `port`, else a free one) until the
    block ends; yields its base URL."""
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


class Proc:
    """A `python -m cli ...` child with its output in a log file (printed when a test fails)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self.args = args
        with log.open("ab") as f:
            self.p = subprocess.Popen(
                [sys.executable, "-m", "cli", *args],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
            )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        return self.p.returncode

    def tail(self, n: int = 60) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return f"--- {' '.join(self.args)} ({self.log}) ---\n" + "\n".join(lines[-n:])


def env_for(tmp: Path, models_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTUNE_")}
    env.update(
        FTUNE_DATA_DIR=str(tmp / "data"),
        FTUNE_MODELS_DIR=str(models_dir),
        FTUNE_HF_CACHE_DIR=str(tmp / "hf-cache"),
        FTUNE_PROGRESS_INTERVAL_SECONDS="0.3",
        FTUNE_BOOTSTRAP_ADMIN_KEY=TEST_ADMIN_KEY,
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def build_demo(family: str, models_dir: Path, tmp: Path) -> None:
    """`ftune models build-demo --family <family>` into `models_dir`, by the real CLI."""
    built = subprocess.run(
        [sys.executable, "-m", "cli", "models", "build-demo", "--family", family],
        env=env_for(tmp, models_dir), cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr


def wait_ready(base: str, procs: list[Proc], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.p.poll() is not None:
                raise RuntimeError(f"process exited early\n{p.tail()}")
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError("service not ready\n" + "\n".join(p.tail() for p in procs))


def training_pid(job_id: str) -> int:
    """The pid of the job's running training process, which its events do not name: the process writing
    to the job's train.log (under torchrun the launcher, not its ranks)."""
    log = f"/jobs/{job_id}/train.log"
    writers: dict[int, int] = {}  # pid -> parent
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.readlink(entry / "fd" / "1").endswith(log):
                writers[int(entry.name)] = int((entry / "stat").read_text().rsplit(") ", 1)[1].split()[1])
        except OSError:
            continue
    top = [pid for pid, parent in writers.items() if parent not in writers]
    assert len(top) == 1, f"training processes of job {job_id}: {writers}"
    return top[0]


def upload(base: str, path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        r = api.post(f"{base}/datasets", files={"file": (path.name, f)})
    assert r.status_code == 201, r.text
    return dict(r.json())


def wait_finished(base: str, job_ids: list[str], timeout: float) -> dict[str, list[dict[str, Any]]]:
    """Poll until every job is terminal; return the snapshots of each job seen on the way."""
    seen: dict[str, list[dict[str, Any]]] = {j: [] for j in job_ids}
    deadline = time.monotonic() + timeout
    pending = set(job_ids)
    while pending and time.monotonic() < deadline:
        for job_id in list(pending):
            job = api.get(f"{base}/jobs/{job_id}").json()
            seen[job_id].append(job)
            if job["status"] in ("succeeded", "failed", "cancelled"):
                pending.discard(job_id)
        time.sleep(0.2)
    if pending:
        raise TimeoutError(f"jobs not finished: {pending}")
    return seen


def wait_status(base: str, job_id: str, status: str, timeout: float = 120) -> dict[str, Any]:
    """Poll until the job has `status`; returns it then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job: dict[str, Any] = api.get(f"{base}/jobs/{job_id}").json()
        if job["status"] == status:
            return job
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} is {api.get(f'{base}/jobs/{job_id}').json()['status']}, not {status}")


def download_adapter(base: str, job_id: str, dest: Path) -> Path:
    r = api.get(f"{base}/jobs/{job_id}/adapter")
    assert r.status_code == 200, r.text
    archive = dest / f"{job_id}.tar.gz"
    archive.write_bytes(r.content)
    out = dest / job_id
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    return out


class Up:
    """`ftune up` as `make up` runs it (API, embedded broker, a training worker and a CPU worker, SQLite),
    on its own data directory and port."""

    def __init__(self, tmp: Path, models_dir: Path, **env: str) -> None:
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.tmp = tmp
        self.env = env_for(tmp, models_dir, FTUNE_API_PORT=str(port), **env)
        self.proc = Proc(["up"], self.env, tmp / "up.log")

    @property
    def log(self) -> Path:
        return self.proc.log

    def tail(self, n: int = 200) -> str:
        return self.proc.tail(n)

    def stop(self) -> int:
        """Ctrl-C, as a user stops it; its exit code."""
        return self.proc.stop(signal.SIGINT, timeout=120)


@contextmanager
def ftune_up(tmp: Path, models_dir: Path, **env: str) -> Iterator[Up]:
    """A ready `ftune up`; on leaving, Ctrl-C stops it and everything must have stopped cleanly: exit code
    0, "stopping" logged, the API no longer answering. Its log is printed if anything failed."""
    up = Up(tmp, models_dir, **env)
    try:
        wait_ready(up.base, [up.proc], timeout=180)
        yield up
    except BaseException:
        print(up.tail())
        raise
    finally:
        code = up.stop()
    assert code == 0, up.tail()
    assert "stopping" in up.log.read_text()
    try:
        httpx.get(f"{up.base}/health", timeout=2)
    except httpx.ConnectError:
        return
    raise AssertionError(f"the API still answers after Ctrl-C\n{up.tail()}")


@contextmanager
def running_api(env: dict[str, str], log: Path) -> Iterator[str]:
    """`ftune migrate`, then `ftune api` alone on env's FTUNE_API_PORT until the block ends; yields its
    base URL (the log's tail printed if it never gets ready or the block fails)."""
    base = f"http://127.0.0.1:{env['FTUNE_API_PORT']}"
    proc: Proc | None = None
    try:
        subprocess.run([sys.executable, "-m", "cli", "migrate"], env=env, check=True, cwd=REPO)
        proc = Proc(["api"], env, log)
        wait_ready(base, [proc])
        yield base
    except BaseException:
        if proc is not None:
            print(proc.tail(80))
        raise
    finally:
        if proc is not None:
            proc.stop()


def tenant_key(database_url: str, tenant: str) -> str:
    """A new API key of `tenant` (created if missing), written straight to the service's database."""
    from models.db import make_engine, make_session_factory, session_scope
    from models.tenants import create_key

    engine = make_engine(database_url)
    try:
        with session_scope(make_session_factory(engine)) as s:
            return create_key(s, tenant)
    finally:
        engine.dispose()
