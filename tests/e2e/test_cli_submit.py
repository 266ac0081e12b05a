"""`ftune jobs submit`: the real CLI submits through models.submission.submit_job, as POST /jobs does:
stored queued on a real database, its two wake-up calls on a real broker (training and token statistics)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import redis

from core.queues import CPU_QUEUE, QUEUE
from core.spec import JobSpec
from models import datasets as datasets_db
from models import jobs as jobs_db
from models.db import make_engine, make_session_factory, session_scope
from models.migrate import upgrade
from models.tenants import get_or_create_tenant
from tests.e2e.stack import REPO, env_for

REPORT = {"valid": True, "format": "instruction", "num_examples": 4, "size_bytes": 10, "sha256": "0" * 64}


def _setup(tmp_path: Path) -> tuple[str, str]:
    """A migrated SQLite database with tenant acme's dataset; a model "tiny" (config only)."""
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "models" / "tiny" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    url = f"sqlite:///{tmp_path / 'ftune.db'}"
    upgrade(url)
    engine = make_engine(url)
    with session_scope(make_session_factory(engine)) as s:
        tenant = get_or_create_tenant(s, "acme")
        datasets_db.create_dataset(s, tenant.id, "ds000001", "d.jsonl", REPORT)
    engine.dispose()
    return url, "ds000001"


def _submit(tmp_path: Path, env: dict[str, str], spec: dict[str, object]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "cli", "jobs", "submit", str(tmp_path / "spec.json"), "--tenant", "acme"]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_submit_stores_the_job_and_wakes_both_queues(tmp_path: Path, embedded_broker: str) -> None:
    url, dataset_id = _setup(tmp_path)
    env = env_for(tmp_path, tmp_path / "models", FTUNE_DATABASE_URL=url, FTUNE_REDIS_URL=embedded_broker)
    done = _submit(tmp_path, env, {"base_model": "tiny", "dataset_id": dataset_id, "max_steps": 5})
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout)
    assert job["status"] == "queued" and job["token_stats"]["status"] == "pending"
    assert JobSpec.model_validate(job["spec"]).max_steps == 5
    broker = redis.Redis.from_url(embedded_broker)
    assert (broker.llen(QUEUE), broker.llen(CPU_QUEUE)) == (1, 1)
    broker.close()
    engine = make_engine(url)
    with make_session_factory(engine)() as s:
        stored = jobs_db.get_job(s, job["id"])
        assert stored is not None and stored.status == "queued" and stored.enqueued_at is not None
    engine.dispose()


def test_a_refused_job_is_a_clear_error_and_stores_nothing(tmp_path: Path, embedded_broker: str) -> None:
    url, _ = _setup(tmp_path)
    env = env_for(tmp_path, tmp_path / "models", FTUNE_DATABASE_URL=url, FTUNE_REDIS_URL=embedded_broker)
    done = _submit(tmp_path, env, {"base_model": "tiny", "dataset_id": "0123456789abcdef"})
    assert done.returncode == 2 and "error (dataset_not_found)" in done.stderr, done.stderr
    bad = _submit(tmp_path, env, {"base_model": "tiny", "dataset_id": "ds000001", "lora_r": 0})
    assert bad.returncode == 2 and "error (invalid_spec)" in bad.stderr and "lora_r" in bad.stderr
    engine = make_engine(url)
    with make_session_factory(engine)() as s:
        assert jobs_db.list_jobs(s, 10, None)[0] == []
    engine.dispose()


def test_beside_ftune_up_it_finds_the_embedded_broker(tmp_path: Path, embedded_broker: str) -> None:
    url, dataset_id = _setup(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "broker-url").write_text(embedded_broker + "\n")  # as `ftune up` leaves it
    env = env_for(tmp_path, tmp_path / "models", FTUNE_DATABASE_URL=url)
    done = _submit(tmp_path, env, {"base_model": "tiny", "dataset_id": dataset_id})
    assert done.returncode == 0, done.stderr
    broker = redis.Redis.from_url(embedded_broker)
    assert broker.llen(QUEUE) == 1
    broker.close()
