"""Pause and resume through a real JobRunner on a real database, with a stand-in training process that
behaves as training.run does: SIGTERM -> checkpoint after the current step, a "stopped" record, exit 3;
started again, it resumes from its newest checkpoint. (Real training: tests/e2e/test_durability.py.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from core.states import JobStatus
from models import jobs as jobs_db
from models.db import session_scope
from tests.worker.runner_env import job_in_db, stand_in_training
from worker.runner import JobRunner

STEPS = 8

TRAIN = stand_in_training(
    f"""
import signal, time
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
ckpts = out / 'checkpoints'
done = sorted(int(p.name.split('-')[1]) for p in ckpts.glob('step-*')) if ckpts.exists() else []
first = done[-1] if done else 0
metrics = (out / 'metrics.jsonl').open('a')
def record(**r):
    metrics.write(json.dumps(r) + '\\n'); metrics.flush()
record(type='start', total_steps={STEPS}, num_examples=4, resumed_from_step=first)
for step in range(first + 1, {STEPS} + 1):
    time.sleep(0.15)
    record(type='step', step=step, total_steps={STEPS}, epoch=step / {STEPS}, loss=1.0 / step, lr=1e-4,
           tokens=10, elapsed_s=step * 0.15)
    if stop:
        (ckpts / f'step-{{step}}').mkdir(parents=True)
        (ckpts / f'step-{{step}}' / 'state.json').write_text(json.dumps({{'step': step}}))
        record(type='checkpoint', step=step, path=str(ckpts / f'step-{{step}}'))
        record(type='stopped', step=step)
        sys.exit(3)
(out / 'adapter').mkdir()
(out / 'adapter' / 'adapter_config.json').write_text('{{}}')
(out / 'adapter' / 'adapter_model.safetensors').write_bytes(b'weights')
"""
)


@pytest.fixture
def env(tmp_path: Path, migrated_url: str):  # type: ignore[no-untyped-def]
    with job_in_db(tmp_path, migrated_url, {}) as (settings, sessions, job_id):
        enqueued: list[str] = []
        yield JobRunner(settings, sessions, enqueued.append, command=TRAIN), sessions, job_id, enqueued


def _job(sessions, job_id: str):  # type: ignore[no-untyped-def]
    with sessions() as s:
        return jobs_db.get_job(s, job_id)


def test_a_paused_run_stops_at_a_checkpoint_and_a_resume_finishes_it(env) -> None:  # type: ignore[no-untyped-def]
    runner, sessions, job_id, enqueued = env
    outcome: list[str] = []
    worker = threading.Thread(target=lambda: outcome.append(runner.run(job_id)))
    worker.start()
    deadline = time.monotonic() + 30
    while (_job(sessions, job_id).step or 0) < 2:
        assert time.monotonic() < deadline and worker.is_alive(), "training did not report steps"
        time.sleep(0.05)
    with session_scope(sessions) as s:
        assert jobs_db.request_pause(s, job_id=job_id)
    worker.join(30)
    assert outcome == ["paused"] and enqueued == []  # a paused job waits for a resume, not a worker
    job = _job(sessions, job_id)
    assert job.status == JobStatus.PAUSED and 2 <= job.step < STEPS and job.lease_until is None
    stopped_at = job.step

    with session_scope(sessions) as s:
        assert jobs_db.resume(s, job_id=job_id)
    assert runner.run(job_id) == "succeeded"
    job = _job(sessions, job_id)
    assert job.status == JobStatus.SUCCEEDED and job.step == STEPS and job.attempt == 2
    with sessions() as s:
        events = jobs_db.list_events(s, job_id, 0, 200)[0]
    kinds = [e.kind for e in events]
    assert kinds.index("pause_requested") < kinds.index("checkpoint_saved") < kinds.index("paused")
    assert kinds.index("paused") < kinds.index("resumed") < kinds.index("succeeded")
    started = [e.data["resumed_from_step"] for e in events if e.kind == "training_started" and e.data]
    assert started == [0, stopped_at]
