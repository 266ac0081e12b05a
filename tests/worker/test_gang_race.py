"""Workers claiming at the same moment, on the real database (PostgreSQL too, where concurrent sessions see
each other's commits mid-transaction): a worker is never leased twice, never leased while it runs a job
it claimed, and a multi-node job is placed on all its nodes or on none.

Each round, six worker threads released by one barrier do what JobRunner.run does: a worker leased as a
node does not claim, any other claims through worker.claiming.claim_next (its own session, as each
worker process has). No step is slowed or patched: the race is the real one. Half the workers are large
enough for a big one-node job, so they claim it while a small worker leases them for a multi-node job
(two claims on different job rows, which nothing else serialises on PostgreSQL).
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from core.catalog import Catalog
from core.settings import Settings
from core.states import OWNED, JobStatus
from core.storage import Storage
from models import jobs as jobs_db
from models import nodes as nodes_db
from models import workers as workers_db
from models.db import session_scope
from models.placement import Placer
from models.tables import Job, NodeLease
from tests.models.test_fairshare_db import CPU_1T, CPU_8G, _submit
from tests.worker.runner_env import TINY_LLAMA
from worker.claiming import claim_next
from worker.nodes import reserved_node

# Large workers first: idle peers are picked in id order, so a multi-node job leases them first
WORKERS = {"a-0": CPU_1T, "a-1": CPU_1T, "a-2": CPU_1T, "b-0": CPU_8G, "b-1": CPU_8G, "b-2": CPU_8G}
# PostgreSQL runs claims at once (without the row locks 2 of 4 runs of 20 rounds failed); SQLite has one
# writer at a time, so there the race checks the claim's logic and fewer rounds do.
ROUNDS = {"postgresql": 20, "sqlite": 8}
# Each round's new jobs, (tenant, base model, num_nodes): 10 nodes wanted of 6 workers, so claims collide
ROUND_JOBS = [("t1", "big", 1), ("t2", "big", 1), ("t3", "tiny", 2), ("t4", "tiny", 3), ("t5", "tiny", 2)]


def act_as_worker(
    sessions: sessionmaker[Session], catalog: Catalog, data: Path, worker: str, start: threading.Barrier
) -> str:
    """One worker's move at the barrier: "node" when leased as one, else what its claim got."""
    placer = Placer(catalog)  # each worker process has its own
    start.wait()
    if reserved_node(sessions, worker) is not None:
        return "node"
    got = claim_next(
        sessions,
        settings=Settings(data_dir=data),
        storage=Storage(data),
        placer=placer,
        devices=WORKERS[worker],
        worker=worker,
    )
    return got[0] if got else "none"


def placements_are_sound(sessions: sessionmaker[Session]) -> int:
    """Assert that no worker is leased twice or leased while it runs a job it claimed, and that every
    running job holds exactly its nodes (ranks 0..N-1 of its attempt, node 0 its claimant) and a queued
    one none. Returns how many multi-node jobs run."""
    with session_scope(sessions) as s:
        running = list(s.scalars(select(Job).where(Job.status.in_(OWNED))))
        leases = list(s.scalars(select(NodeLease)))
    owners = [j.worker_id or "" for j in running]
    assert len(owners) == len(set(owners)), f"a worker claimed two jobs: {sorted(owners)}"
    assert len({n.worker_id for n in leases}) == len(leases)
    by_job: dict[str, list[NodeLease]] = defaultdict(list)
    for n in leases:
        by_job[n.job_id].append(n)
    gangs = 0
    for job in running:
        want = int(job.spec.get("num_nodes") or 1)
        nodes = sorted(by_job.pop(job.id, []), key=lambda n: n.rank)
        if want == 1:
            assert nodes == [], f"a one-node job holds nodes: {job.id}"
            continue
        gangs += 1
        assert [n.rank for n in nodes] == list(range(want)), f"job {job.id} half-placed: {nodes}"
        assert nodes[0].worker_id == job.worker_id and {n.attempt for n in nodes} == {job.attempt}
    assert not by_job, f"leases of jobs that do not run: {sorted(by_job)}"
    peers = {n.worker_id for n in leases if n.rank > 0}
    assert not peers & set(owners), f"leased while running its own job: {sorted(peers & set(owners))}"
    return gangs


def end_running_jobs(sessions: sessionmaker[Session]) -> None:
    with session_scope(sessions) as s:
        for job in list(s.scalars(select(Job).where(Job.status.in_(OWNED)))):
            jobs_db.finish(s, job_id=job.id, attempt=job.attempt, dst=JobStatus.SUCCEEDED, message="done")
            nodes_db.release(s, job_id=job.id)


@pytest.fixture
def catalog(tmp_path: Path) -> Catalog:
    """The tiny model, and a 7B Llama that only the large workers' memory fits."""
    for name, config in (("tiny", TINY_LLAMA), ("big", {"model_type": "llama"})):
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "config.json").write_text(json.dumps(config))
    return Catalog(tmp_path / "models")


def test_racing_claims_never_share_a_worker_nor_half_place_a_job(
    sessions: sessionmaker[Session], catalog: Catalog, tmp_path: Path
) -> None:
    with session_scope(sessions) as s:
        for w, devices in WORKERS.items():
            workers_db.register(s, w, "127.0.0.1", devices)
    moves: dict[str, int] = defaultdict(int)
    gangs = 0
    rounds = ROUNDS[sessions.kw["bind"].dialect.name]
    with ThreadPoolExecutor(len(WORKERS)) as pool:
        for _ in range(rounds):
            for tenant, model, nodes in ROUND_JOBS:
                _submit(sessions, tenant, 1, base_model=model, num_nodes=nodes)
            start = threading.Barrier(len(WORKERS))
            futures = [
                pool.submit(act_as_worker, sessions, catalog, tmp_path / "data", w, start) for w in WORKERS
            ]
            for f in futures:  # a claim that failed (a deadlock, an integrity error) raises here
                got = f.result(timeout=60)
                moves["none" if got == "none" else "node" if got == "node" else "claimed"] += 1
            gangs += placements_are_sound(sessions)
            end_running_jobs(sessions)
    print(f"\n{rounds} rounds of {len(WORKERS)} racing workers: {dict(moves)}, {gangs} multi-node jobs")
    assert gangs >= rounds  # the race was run: multi-node jobs were placed every round, on average
