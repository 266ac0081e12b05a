"""Gang placement of multi-node jobs at claim time, on the real database: all of a job's nodes are leased
in one transaction or none, and a job whose other worker is busy holds nothing while it waits."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from core.catalog import Catalog
from core.queues import worker_queue
from core.settings import Settings
from core.states import JobStatus
from core.storage import Storage
from models import jobs as jobs_db
from models import nodes as nodes_db
from models import workers as workers_db
from models.db import session_scope
from models.placement import Placer
from models.tables import NodeLease, utcnow
from tests.models.test_fairshare_db import CPU_8G, _submit
from tests.worker.runner_env import TINY_LLAMA
from worker.claiming import claim_next
from worker.nodes import wake_peers


def claim(
    sessions: sessionmaker[Session], placer: Placer, worker: str, tmp_path: Path
) -> tuple[str, int] | None:
    settings = Settings(data_dir=tmp_path)
    return claim_next(
        sessions, settings=settings, storage=Storage(tmp_path), placer=placer, devices=CPU_8G, worker=worker
    )


@pytest.fixture
def placer(tmp_path: Path) -> Placer:
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY_LLAMA))
    return Placer(Catalog(tmp_path))


@pytest.fixture
def fleet(sessions: sessionmaker[Session]) -> list[str]:
    with session_scope(sessions) as s:
        for w in ("w-a", "w-b"):
            workers_db.register(s, w, "127.0.0.1", CPU_8G)
    return ["w-a", "w-b"]


def leases(sessions: sessionmaker[Session]) -> list[tuple[str, str, int, str]]:
    with session_scope(sessions) as s:
        rows = s.query(NodeLease).order_by(NodeLease.rank).all()
        return [(n.worker_id, n.job_id, n.rank, n.endpoint) for n in rows]


def status(sessions: sessionmaker[Session], job_id: str) -> tuple[str, str | None]:
    with session_scope(sessions) as s:
        job = jobs_db.get_job(s, job_id)
        assert job is not None
        return job.status, job.worker_id


def test_a_two_node_job_leases_both_workers_at_once(sessions, placer, fleet, tmp_path) -> None:
    (job,) = _submit(sessions, "aaa", 1, num_nodes=2)
    assert claim(sessions, placer, "w-a", tmp_path) == (job, 1)
    held = leases(sessions)
    assert [(w, j, r) for w, j, r, _ in held] == [("w-a", job, 0), ("w-b", job, 1)]
    assert held[0][3] == held[1][3] and held[0][3].startswith("127.0.0.1:")
    assert status(sessions, job) == (JobStatus.RUNNING, "w-a")


def test_one_worker_busy_never_holds_the_other(sessions, placer, fleet, tmp_path) -> None:
    (busy,) = _submit(sessions, "bbb", 1)
    assert claim(sessions, placer, "w-b", tmp_path) == (busy, 1)  # w-b now runs a one-node job
    (gang,) = _submit(sessions, "aaa", 1, num_nodes=2)
    (single,) = _submit(sessions, "ccc", 1)
    # w-a cannot place the 2-node job: it holds nothing for it and runs the next job it can instead
    assert claim(sessions, placer, "w-a", tmp_path) == (single, 1)
    assert leases(sessions) == []
    assert status(sessions, gang) == (JobStatus.QUEUED, None)
    with session_scope(sessions) as s:
        jobs_db.finish(s, job_id=single, attempt=1, dst=JobStatus.SUCCEEDED, message="done")
        jobs_db.finish(s, job_id=busy, attempt=1, dst=JobStatus.SUCCEEDED, message="done")
    assert claim(sessions, placer, "w-b", tmp_path) == (gang, 1)  # both free now: w-b is node 0
    assert [(w, r) for w, _, r, _ in leases(sessions)] == [("w-b", 0), ("w-a", 1)]


def test_a_peer_taken_meanwhile_rolls_the_whole_claim_back(
    sessions, placer, fleet, tmp_path, monkeypatch
) -> None:
    (gang,) = _submit(sessions, "aaa", 1, num_nodes=2)
    (other,) = _submit(sessions, "bbb", 1, num_nodes=2)
    with session_scope(sessions) as s:  # another claim leased w-b between the check and the insert
        nodes_db.reserve(s, job_id=other, attempt=1, workers=["w-b"], endpoint="h:1", lease_seconds=60)
    stale_view = nodes_db.idle_peers
    monkeypatch.setattr(
        nodes_db,
        "idle_peers",
        lambda s, fits, claimant: [
            *stale_view(s, fits=fits, claimant=claimant),
            s.get(workers_db.Worker, "w-b"),
        ],
    )
    assert claim(sessions, placer, "w-a", tmp_path) is None
    assert status(sessions, gang) == (JobStatus.QUEUED, None)
    assert [w for w, *_ in leases(sessions)] == ["w-b"]  # only the other job's


def test_node_0_wakes_the_other_nodes_on_their_own_queues(sessions, placer, fleet, tmp_path) -> None:
    (gang,) = _submit(sessions, "aaa", 1, num_nodes=2)
    assert claim(sessions, placer, "w-a", tmp_path) == (gang, 1)
    sent: list[tuple[str, str]] = []

    def send(queue: str, job_id: str) -> bool:
        sent.append((queue, job_id))
        return True

    assert wake_peers(sessions, gang, 1, send) == ["w-b"]
    assert sent == [(worker_queue("w-b"), gang)]  # w-b alone, not a queue any worker takes
    assert wake_peers(sessions, gang, 2, send) == [] and len(sent) == 1  # not the leased attempt


def test_a_worker_leased_as_a_node_meanwhile_claims_nothing(sessions, placer, fleet, tmp_path) -> None:
    (single,) = _submit(sessions, "bbb", 1)
    (other,) = _submit(sessions, "aaa", 1, num_nodes=2)
    with session_scope(sessions) as s:  # w-a placed a 2-node job on w-b after w-b looked for a lease
        nodes_db.reserve(s, job_id=other, attempt=1, workers=["w-a", "w-b"], endpoint="h:1", lease_seconds=60)
    assert claim(sessions, placer, "w-b", tmp_path) is None  # its node runs instead of a job of its own
    assert status(sessions, single) == (JobStatus.QUEUED, None)
    assert [w for w, *_ in leases(sessions)] == ["w-a", "w-b"]


def test_a_lost_worker_frees_its_node_and_an_ended_attempt_frees_all(
    sessions, placer, fleet, tmp_path
) -> None:
    (gang,) = _submit(sessions, "aaa", 1, num_nodes=2)
    assert claim(sessions, placer, "w-a", tmp_path) == (gang, 1)
    with session_scope(sessions) as s:
        assert nodes_db.extend(s, worker_id="w-b", job_id=gang, attempt=1, lease_seconds=60)
        # w-b renewed for 60 s, then its worker died: past that, its node is freed, node 0's is not
        assert nodes_db.release_stale(s, now=utcnow() + timedelta(seconds=61)) == 1
    assert [w for w, *_ in leases(sessions)] == ["w-a"]
    with session_scope(sessions) as s:
        assert not nodes_db.extend(s, worker_id="w-b", job_id=gang, attempt=1, lease_seconds=60)
        jobs_db.finish(s, job_id=gang, attempt=1, dst=JobStatus.SUCCEEDED, message="done")
        assert nodes_db.release_stale(s) == 1  # w-a's: its attempt is no longer running
