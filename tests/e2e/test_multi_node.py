"""A 2-node job on two real workers on one machine (gloo, c10d rendezvous at node 0's worker), with a real
API, Redis and database:

1. The 2-node job (micro 2 on each node) trains the adapter a one-process job trains from the same global
   batch (micro 4), per-tensor Frobenius <= 1e-4, packed and padded.
2. kill -9 of the second node's worker mid-run: the attempt stops, the worker is started again under its
   name, the job resumes from its checkpoint and ends with the adapter of an uninterrupted twin, bit for bit.
3. A cancel stops both nodes well within the reaper's bound (the lease).
In each, the other node starts within seconds of the job's placement: node 0's worker wakes it on its own
queue, well before the workers' tick (8 s here, so that a missed wake-up would show).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file

from core.settings import Settings
from core.storage import CHECKPOINTS_DIR, Storage
from models.db import make_engine, make_session_factory, session_scope
from models.tables import NodeLease, Worker
from models.tenants import create_key
from tests.conftest import reachable, redis_database
from tests.e2e.stack import REPO, Proc, env_for, free_port, wait_finished, wait_ready, wait_status
from tests.training.util import relative_difference

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not reachable("127.0.0.1", 6379), reason="Redis is not running on 127.0.0.1:6379"),
]

DATASET = REPO / "examples" / "alpaca_small.jsonl"
NODES = ("a", "b")
COMMON = {"base_model": "ftune-demo", "method": "lora", "max_seq_len": 128, "lora_dropout": 0.1, "seed": 7}
TWO_NODES = {"num_nodes": 2, "micro_batch_size": 2, "gradient_accumulation_steps": 1}
ONE_PROCESS = {"micro_batch_size": 4, "gradient_accumulation_steps": 1}
LEASE_S = Settings().lease_seconds  # the reaper's bound: a node's lease
# The workers' tick: long enough that a peer found on a tick, not woken, would show (woken: 0.02-0.23 s),
# short enough that the kill -9 and cancel tests' reaper does not hold the suite.
TICK_S = 8.0


class TwoNodes:
    def __init__(self, tmp: Path, models_dir: Path, redis_url: str) -> None:
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.tmp = tmp
        db_url = f"sqlite:///{tmp / 'nodes.db'}"
        self.env = env_for(
            tmp,
            models_dir,
            FTUNE_API_PORT=str(port),
            FTUNE_DATABASE_URL=db_url,
            FTUNE_REDIS_URL=redis_url,
            FTUNE_REAPER_INTERVAL_SECONDS=str(TICK_S),
            FTUNE_FORK_TRAINING="false",
            OMP_NUM_THREADS="1",
        )
        subprocess.run([sys.executable, "-m", "cli", "migrate"], env=self.env, check=True, cwd=REPO)
        self.sessions = make_session_factory(make_engine(db_url))
        with session_scope(self.sessions) as s:
            key = create_key(s, "alpha")
        self.client = httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        self.storage = Storage(tmp / "data")
        self.api = Proc(["api"], self.env, tmp / "api.log")
        self.workers = {n: self.start_worker(n) for n in NODES}
        wait_ready(self.base, [self.api, *self.workers.values()])
        self.wait_registered()
        with DATASET.open("rb") as f:
            r = self.client.post("/datasets", files={"file": (DATASET.name, f)})
        assert r.status_code == 201, r.text
        self.dataset = r.json()["id"]

    def start_worker(self, name: str) -> Proc:
        env = {**self.env, "FTUNE_WORKER_NAME": f"node-{name}", "FTUNE_WORKER_DEVICES": "cpu:16GiB"}
        return Proc(["worker"], env, self.tmp / f"worker-{name}.log")

    def wait_registered(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.sessions() as s:
                if {w.id for w in s.query(Worker).all() if not w.stopped} >= {f"node-{n}" for n in NODES}:
                    return
            time.sleep(0.3)
        raise TimeoutError("workers not registered\n" + self.tails())

    def submit(self, **spec: Any) -> str:
        r = self.client.post("/jobs", json={**COMMON, **spec, "dataset_id": self.dataset})
        assert r.status_code == 202, r.text
        return str(r.json()["id"])

    def nodes(self, job_id: str) -> dict[int, str]:
        with self.sessions() as s:
            return {n.rank: n.worker_id for n in s.query(NodeLease).filter(NodeLease.job_id == job_id)}

    def wait_nodes(self, job_id: str, timeout: float = 120) -> dict[int, str]:
        deadline = time.monotonic() + timeout
        while len(nodes := self.nodes(job_id)) < 2:
            assert time.monotonic() < deadline, self.tails()
            time.sleep(0.2)
        return nodes

    def wait_running(self, job_id: str, timeout: float = 120) -> tuple[dict[int, str], float]:
        """The job's nodes, and the seconds from its placement (both nodes leased) to a training process
        under each node's worker."""
        deadline = time.monotonic() + timeout
        while len(nodes := self.nodes(job_id)) < 2:
            assert time.monotonic() < deadline, self.tails()
            time.sleep(0.05)
        placed = time.monotonic()
        while not all(self.trainers(n, job_id) for n in NODES):
            assert time.monotonic() < deadline, self.tails()
            time.sleep(0.05)
        seconds = time.monotonic() - placed
        print(f"\njob {job_id}: placement to every node running {seconds:.2f} s (tick {TICK_S:.0f} s)")
        return nodes, seconds

    def adapter(self, job_id: str) -> dict[str, torch.Tensor]:
        return load_file(self.storage.adapter_dir(job_id) / "adapter_model.safetensors")

    def trainers(self, name: str, job_id: str = "") -> list[psutil.Process]:
        """The training processes under a worker (its torchrun and the ranks), of one job if given (its
        torchrun's command names the job's run.json)."""
        found = []
        for p in psutil.Process(self.workers[name].p.pid).children(recursive=True):
            try:
                if job_id in " ".join(p.cmdline()):
                    found.append(p)
            except psutil.Error:  # ended meanwhile
                continue
        return found

    def tails(self) -> str:
        return "\n".join(p.tail(40) for p in (self.api, *self.workers.values()))

    def close(self) -> None:
        for p in self.workers.values():
            p.stop()
        self.api.stop()
        self.client.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[TwoNodes]:
    with redis_database() as redis_url:
        s = TwoNodes(tmp_path_factory.mktemp("nodes"), models_dir, redis_url)
        try:
            yield s
        except BaseException:
            print(s.tails())
            raise
        finally:
            s.close()


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_two_workers_as_two_nodes_train_what_one_process_trains(stack: TwoNodes, packing: bool) -> None:
    two = stack.submit(max_steps=6, packing=packing, **TWO_NODES)
    nodes, start_s = stack.wait_running(two)
    assert set(nodes.values()) == {"node-a", "node-b"}
    assert start_s < TICK_S / 2  # woken, not found on a tick
    one = stack.submit(max_steps=6, packing=packing, **ONE_PROCESS)
    wait_finished(stack.base, [two, one], timeout=600)
    for job in (two, one):
        assert stack.client.get(f"/jobs/{job}").json()["status"] == "succeeded", stack.tails()
    diff = relative_difference(stack.adapter(one), stack.adapter(two))
    print(f"\n{'packed' if packing else 'padded'}: two worker nodes vs one process: Frobenius {diff:.1e}")
    assert diff <= 1e-4
    assert stack.nodes(two) == {}  # every node freed


def test_kill_9_of_the_second_node_resumes_to_the_uninterrupted_adapter(stack: TwoNodes) -> None:
    spec = {**TWO_NODES, "max_steps": 20, "checkpoint_every_steps": 4}  # killed after step 4 of 20
    killed = stack.submit(**spec)
    second = stack.wait_nodes(killed)[1].removeprefix("node-")
    checkpoints = stack.storage.job_dir(killed) / CHECKPOINTS_DIR
    deadline = time.monotonic() + 300
    while not (checkpoints.exists() and any(checkpoints.glob("step-*"))):
        assert time.monotonic() < deadline, stack.tails()
        time.sleep(0.2)
    stack.workers[second].p.send_signal(signal.SIGKILL)  # the worker alone: its node stops with it
    stack.workers[second].p.wait()
    stack.workers[second] = stack.start_worker(second)
    wait_status(stack.base, killed, "succeeded", timeout=600)
    events = [e["kind"] for e in stack.client.get(f"/jobs/{killed}/events").json()["data"]]
    assert events.count("started") >= 2, events
    twin = stack.submit(**spec)
    wait_status(stack.base, twin, "succeeded", timeout=600)
    a, b = stack.adapter(killed), stack.adapter(twin)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"\nkill -9 of node 1's worker: {events.count('started')} attempts; adapter equals the twin's")


def test_a_cancel_stops_both_nodes(stack: TwoNodes) -> None:
    job = stack.submit(**TWO_NODES, max_steps=100_000)
    assert stack.wait_running(job)[1] < TICK_S / 2
    deadline = time.monotonic() + 300
    while stack.client.get(f"/jobs/{job}").json()["progress"]["step"] < 1:
        assert time.monotonic() < deadline, stack.tails()
        time.sleep(0.2)
    assert all(stack.trainers(n) for n in NODES)  # both nodes train under their workers
    start = time.monotonic()
    assert stack.client.post(f"/jobs/{job}/cancel").status_code == 202
    wait_status(stack.base, job, "cancelled", timeout=LEASE_S)
    while any(stack.trainers(n) for n in NODES):
        assert time.monotonic() - start < LEASE_S, [stack.trainers(n) for n in NODES]
        time.sleep(0.2)
    print(f"\ncancel: both nodes' trainers gone in {time.monotonic() - start:.1f} s (bound {LEASE_S:.0f} s)")
