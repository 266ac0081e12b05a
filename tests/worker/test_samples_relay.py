"""The worker stores samples records: one event per set and the job's samples file; a resumed run that
samples its end again replaces that set and adds no second event."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from core.run_protocol import Record, SampleItem, SamplesRecord, StartRecord, encode
from core.settings import Settings
from core.spec import JobSpec
from core.storage import Storage
from models import datasets as datasets_db
from models import jobs as jobs_db
from models.db import make_engine, make_session_factory, session_scope
from models.migrate import upgrade
from models.tenants import get_or_create_tenant
from worker.runner import JobRunner

JOB = "job00000001"
SPEC = JobSpec(base_model="m", dataset_id="ds000001", sample_prompts=["p"])
REPORT = {"valid": True, "format": "instruction", "num_examples": 3, "size_bytes": 10, "sha256": "0" * 64}


@pytest.fixture
def sessions(sqlite_url: str) -> Iterator[sessionmaker[Session]]:
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    yield make_session_factory(engine)
    engine.dispose()


def samples(step: int, at: str, tuned: str) -> SamplesRecord:
    return SamplesRecord(step=step, at=at, items=[SampleItem(prompt="p", base="b", tuned=tuned)])


def test_samples_become_events_and_a_file_without_duplicates_across_a_resume(
    sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    with session_scope(sessions) as s:
        tenant = get_or_create_tenant(s, "t")
        datasets_db.create_dataset(s, tenant.id, "ds000001", "a.jsonl", REPORT)
        jobs_db.create_job(s, tenant.id, JOB, SPEC, predicted_peak_bytes=1)
        attempt = jobs_db.claim(s, job_id=JOB, worker_id="w1", lease_seconds=60)
    settings = Settings(data_dir=tmp_path / "data", models_dir=tmp_path / "models")
    runner = JobRunner(settings, sessions, enqueue=lambda job_id: True)
    storage = Storage(settings.data_dir)
    storage.job_dir(JOB).mkdir(parents=True)

    def relay(*records: Record) -> None:  # as training appends them and the worker's tail reads them
        with storage.metrics_path(JOB).open("a") as f:
            f.write("".join(encode(r) + "\n" for r in records))
        assert runner.recorder.relay(JOB, attempt, list(records))

    relay(StartRecord(total_steps=4, num_examples=3), samples(2, "eval", "at 2"), samples(4, "end", "end"))
    # The process died after its end samples, before done: the next attempt resumes at step 4.
    relay(StartRecord(total_steps=4, num_examples=3, resumed_from_step=4), samples(4, "end", "end again"))

    doc = json.loads(storage.samples_path(JOB).read_text())
    assert [(x["step"], x["at"], x["items"][0]["tuned"]) for x in doc["sets"]] == [
        (2, "eval", "at 2"),
        (4, "end", "end again"),
    ]
    with sessions() as s:
        job = jobs_db.get_job(s, JOB)
        assert job is not None
        events = [(e.message, e.data) for e in job.events if e.kind == "samples"]
    assert [m for m, _ in events] == [
        "samples at step 2 (at evaluation): 1 prompt",
        "samples at step 4 (at the end): 1 prompt",
    ]
    assert events[1][1] == {"step": 4, "at": "end", "items": [{"prompt": "p", "base": "b", "tuned": "end"}]}
