"""Fair share and placement at claim time, on SQLite and PostgreSQL: the claim picks the next job by the
policy among the jobs the worker's devices fit, whatever job its message named."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from core.catalog import Catalog
from core.spec import JobSpec
from core.states import JobStatus
from core.storage import new_id
from models import datasets as datasets_db
from models import fairshare
from models import jobs as jobs_db
from models import workers as workers_db
from models.db import make_engine, make_session_factory, session_scope
from models.placement import Placer, waiting_reason
from models.tenants import get_or_create_tenant
from tests.worker.runner_env import TINY_LLAMA

REPORT = {"valid": True, "format": "text", "num_examples": 3, "size_bytes": 10, "sha256": "0" * 64}
GiB = 2**30


@pytest.fixture
def sessions(migrated_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(migrated_url)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture
def placer(tmp_path: Path) -> Placer:
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY_LLAMA))
    (tmp_path / "big").mkdir()  # a 7B Llama: tens of GiB to fine-tune on a CPU
    (tmp_path / "big" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return Placer(Catalog(tmp_path))


def _submit(sessions: sessionmaker[Session], tenant: str, n: int, **spec: object) -> list[str]:
    ids = []
    with session_scope(sessions) as s:
        t = get_or_create_tenant(s, tenant)
        ds = f"ds{tenant:0>8}"
        if datasets_db.get_dataset(s, ds) is None:
            datasets_db.create_dataset(s, t.id, ds, "a.jsonl", REPORT)
        for _ in range(n):
            job_id = new_id()
            job_spec = JobSpec.model_validate({"base_model": "tiny", "dataset_id": ds, **spec})
            jobs_db.create_job(s, t.id, job_id, job_spec)
            ids.append(job_id)
    return ids


def _claim(sessions: sessionmaker[Session], placer: Placer, devices: list, limit: int = 0) -> str | None:
    with session_scope(sessions) as s:
        got = fairshare.claim_next(
            s,
            can_run=lambda j: placer.fits(j, devices),
            worker_id="w",
            lease_seconds=60,
            running_limit=limit,
        )
        return got[0].id if got else None


def _finish(sessions: sessionmaker[Session], job_id: str) -> None:
    with session_scope(sessions) as s:
        job = jobs_db.get_job(s, job_id)
        assert job is not None
        assert jobs_db.finish(s, job_id=job_id, attempt=job.attempt, dst=JobStatus.SUCCEEDED, message="ok")


CPU_8G = [{"name": "cpu", "kind": "cpu", "memory_bytes": 8 * GiB}]
CPU_1T = [{"name": "cpu", "kind": "cpu", "memory_bytes": 1024 * GiB}]


def test_a_tenant_with_one_job_goes_next_behind_another_tenants_many(
    sessions: sessionmaker[Session], placer: Placer
) -> None:
    many = _submit(sessions, "aaa", 6)
    (single,) = _submit(sessions, "bbb", 1)
    order = []
    while (job_id := _claim(sessions, placer, CPU_8G)) is not None:
        order.append(job_id)
        _finish(sessions, job_id)
    # aaa's oldest first (both unserved: the older job), then bbb in the next free slot, then aaa's FIFO
    assert order == [many[0], single, *many[1:]]


def test_with_two_slots_the_busy_tenant_waits_for_the_idle_one(
    sessions: sessionmaker[Session], placer: Placer
) -> None:
    a = _submit(sessions, "aaa", 4)
    first = _claim(sessions, placer, CPU_8G)
    (b,) = _submit(sessions, "bbb", 1)
    second = _claim(sessions, placer, CPU_8G)  # aaa has one running, bbb none
    assert (first, second) == (a[0], b)


def test_priority_orders_a_tenants_own_jobs_only(sessions: sessionmaker[Session], placer: Placer) -> None:
    low = _submit(sessions, "aaa", 1)
    high = _submit(sessions, "aaa", 1, priority=5)
    order = [_claim(sessions, placer, CPU_8G), _claim(sessions, placer, CPU_8G)]
    assert order == [high[0], low[0]]


def test_the_per_tenant_running_limit_holds_and_other_tenants_pass(
    sessions: sessionmaker[Session], placer: Placer
) -> None:
    a = _submit(sessions, "aaa", 3)
    b = _submit(sessions, "bbb", 1)
    claims = [_claim(sessions, placer, CPU_8G, limit=1) for _ in range(3)]
    assert claims == [a[0], b[0], None]  # aaa holds its one slot; its others wait though a slot is free
    _finish(sessions, a[0])
    assert _claim(sessions, placer, CPU_8G, limit=1) == a[1]


def test_a_worker_claims_only_jobs_its_devices_fit_and_the_rest_say_why(
    sessions: sessionmaker[Session], placer: Placer
) -> None:
    (big,) = _submit(sessions, "aaa", 1, base_model="big")
    (small,) = _submit(sessions, "bbb", 1)
    assert _claim(sessions, placer, CPU_8G) == small  # the older big job does not fit 8 GiB
    assert _claim(sessions, placer, CPU_8G) is None
    with session_scope(sessions) as s:
        workers_db.register(s, "small-w", "h", CPU_8G)
        job = jobs_db.get_job(s, big)
        assert job is not None
        reason = waiting_reason(placer, job, workers_db.fleet(s), free={"small-w"})
    assert reason is not None and reason.startswith("waiting for a worker with >= ")
    assert reason.endswith("GiB per device, 0 alive of 1")
    need = float(reason.split(">= ")[1].split(" GiB")[0])
    assert 8 < need < 1024
    assert _claim(sessions, placer, CPU_1T) == big
    with session_scope(sessions) as s:
        workers_db.register(s, "big-w", "h", CPU_1T)
        job = jobs_db.get_job(s, small)
        assert job is not None and waiting_reason(placer, job, workers_db.fleet(s), free=set()) is None


def test_a_job_needing_more_devices_or_bf16_does_not_fit(
    placer: Placer, sessions: sessionmaker[Session]
) -> None:
    (two,) = _submit(sessions, "aaa", 1, num_gpus=2)
    (bf16,) = _submit(sessions, "bbb", 1, mixed_precision="bf16")
    one_a100 = [{"name": "A100-80GB", "kind": "declared"}]
    two_t4 = [{"name": "T4", "kind": "declared"}] * 2
    with sessions() as s:
        jobs = {j: jobs_db.get_job(s, j) for j in (two, bf16)}
    assert not placer.fits(jobs[two], one_a100) and placer.fits(jobs[two], two_t4)  # type: ignore[arg-type]
    assert placer.fits(jobs[bf16], one_a100) and not placer.fits(jobs[bf16], two_t4)  # type: ignore[arg-type]
