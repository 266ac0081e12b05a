"""The worker relays a run's measured peak and the planner's prediction for it onto the job row."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from api.schemas import job_out
from core.run_protocol import CheckpointRecord, Record, StartRecord, StepRecord
from core.settings import Settings
from core.spec import JobSpec
from models import datasets as datasets_db
from models import jobs as jobs_db
from models.db import make_engine, make_session_factory, session_scope
from models.migrate import upgrade
from models.openai_jobs import checkpoints
from models.tenants import get_or_create_tenant
from worker.runner import JobRunner

SPEC = JobSpec(base_model="m", dataset_id="ds000001")
REPORT = {"valid": True, "format": "instruction", "num_examples": 3, "size_bytes": 10, "sha256": "0" * 64}


def claimed_job(sessions: sessionmaker[Session]) -> int:
    """job00000001, created and claimed by w1; its attempt."""
    with session_scope(sessions) as s:
        tenant = get_or_create_tenant(s, "t")
        datasets_db.create_dataset(s, tenant.id, "ds000001", "a.jsonl", REPORT)
        jobs_db.create_job(s, tenant.id, "job00000001", SPEC, predicted_peak_bytes=111)  # admission's plan
        return jobs_db.claim(s, job_id="job00000001", worker_id="w1", lease_seconds=60)


@pytest.fixture
def sessions(sqlite_url: str) -> Iterator[sessionmaker[Session]]:
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    yield make_session_factory(engine)
    engine.dispose()


def test_start_and_step_records_put_prediction_and_measurement_on_the_job(
    sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    attempt = claimed_job(sessions)
    assert attempt == 1
    settings = Settings(data_dir=tmp_path / "data", models_dir=tmp_path / "models")
    runner = JobRunner(settings, sessions, enqueue=lambda job_id: True)
    records: list[Record] = [
        StartRecord(total_steps=4, num_examples=3, predicted_peak_bytes=5_000_000),
        StepRecord(
            step=1, total_steps=4, epoch=0.25, loss=2.0, lr=1e-4, tokens=9, elapsed_s=1.0,
            peak_mem_bytes=4_900_000,
        ),
    ]  # fmt: skip
    assert runner.recorder.relay("job00000001", attempt, records)
    with sessions() as s:
        job = jobs_db.get_job(s, "job00000001")
        assert job is not None
        out = job_out(job)
    # the plan for the device the run used replaces admission's plan for the fleet's device
    assert (out.predicted_peak_bytes, out.peak_mem_bytes) == (5_000_000, 4_900_000)


def test_a_checkpoint_pruned_while_it_is_hashed_is_skipped_and_the_job_goes_on(
    sessions: sessionmaker[Session], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training keeps the newest keep_checkpoints and prunes the older ones as it goes on, so a checkpoint
    the worker is hashing can vanish under it (seen once in the suite: the job failed with internal_error
    after training succeeded). Such a checkpoint is skipped, as one pruned before the worker saw it."""
    from worker import artifacts

    attempt = claimed_job(sessions)
    settings = Settings(data_dir=tmp_path / "data", models_dir=tmp_path / "models")
    runner = JobRunner(settings, sessions, enqueue=lambda job_id: True)
    kept, pruned = (runner.storage.job_dir("job00000001") / "checkpoints" / f"step-{n}" for n in (2, 1))
    for d in (kept, pruned):
        d.mkdir(parents=True)
        (d / "state.json").write_text("{}")
    read = artifacts.sha256_file

    def pruned_meanwhile(f: Path) -> str:  # the directory listed, then pruned before its files are read
        if pruned in f.parents:
            shutil.rmtree(pruned)
        return read(f)

    monkeypatch.setattr(artifacts, "sha256_file", pruned_meanwhile)
    records: list[Record] = [CheckpointRecord(step=n, path=str(d)) for n, d in ((1, pruned), (2, kept))]
    assert runner.recorder.relay("job00000001", attempt, records)
    with sessions() as s:
        assert [a.step for a in checkpoints(s, "job00000001")] == [2]
