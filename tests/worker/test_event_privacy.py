"""A job's events name no server path and no process id, natively and under /v1: a JobRunner on a real
database runs a stand-in that reports as training.run does (a start, a step, a checkpoint by its absolute
path, the adapter, done), the real recording code stores the events, and the API lists them."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from api.main import create_app
from core.errors import without_paths
from models import jobs as jobs_db
from models.db import session_scope
from models.tenants import create_key
from tests.worker.runner_env import job_in_db, stand_in_training
from worker.runner import JobRunner

TRAIN = stand_in_training(
    """
import os
(out / 'pid').write_text(str(os.getpid()))
ckpt = out / 'checkpoints' / 'step-00000001'
ckpt.mkdir(parents=True)
(ckpt / 'state.json').write_text('{}')
metrics = (out / 'metrics.jsonl').open('a')
def record(**r):
    metrics.write(json.dumps(r) + '\\n'); metrics.flush()
record(type='start', total_steps=1, num_examples=4)
record(type='step', step=1, total_steps=1, epoch=1.0, loss=0.5, lr=1e-4, tokens=10, elapsed_s=0.1)
record(type='checkpoint', step=1, path=str(ckpt))
(out / 'adapter').mkdir()
(out / 'adapter' / 'adapter_config.json').write_text('{}')
(out / 'adapter' / 'adapter_model.safetensors').write_bytes(b'weights')
record(type='done', step=1, adapter_dir=str(out / 'adapter'))
"""
)


def _values(obj: Any) -> Iterator[tuple[str | None, Any]]:
    """Every (key, value) of a JSON document, nested ones too (a list's items under key None)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k, v
            yield from _values(v)
    elif isinstance(obj, list):
        for v in obj:
            yield None, v
            yield from _values(v)


def test_events_name_no_server_path_and_no_process_id(tmp_path: Path, migrated_url: str) -> None:
    with job_in_db(tmp_path, migrated_url, {"checkpoint_every_steps": 1}) as (settings, sessions, job_id):
        assert JobRunner(settings, sessions, lambda _: True, command=TRAIN).run(job_id) == "succeeded"
        app = create_app(settings, enqueue=lambda _: True, token_stats=lambda _: True)
        with session_scope(sessions) as s:
            key = create_key(s, "acme")
        with TestClient(app, headers={"Authorization": f"Bearer {key}"}) as client:
            native = client.get(f"/jobs/{job_id}/events?limit=500").json()["data"]
            v1 = client.get(f"/v1/fine_tuning/jobs/{job_id}/events?limit=100").json()["data"]
        app.state.services.engine.dispose()
        child = int((settings.data_dir / "jobs" / job_id / "pid").read_text())

    kinds = {e["kind"] for e in native}
    assert {"process_started", "placed", "started", "checkpoint_saved", "succeeded"} <= kinds, kinds
    saved = next(e for e in native if e["kind"] == "checkpoint_saved")
    assert saved["data"]["step"] == 1 and saved["data"]["size_bytes"] == 2  # its step and size
    assert any(e["type"] == "message" and "checkpoint at step 1" in e["message"] for e in v1)
    for events in (native, v1):
        text = json.dumps(events)
        assert without_paths(text) == text and str(tmp_path) not in text, text  # no absolute path
        for key_, value in _values(events):
            assert key_ != "pid", events
            for pid in (child, os.getpid()):  # the training process's, the worker's
                assert value != pid, (key_, value)
                assert not (isinstance(value, str) and re.search(rf"\b{pid}\b", value)), (key_, value)


def test_an_internal_error_names_no_server_path(tmp_path: Path, migrated_url: str) -> None:
    """A run that cannot even start (here: its command is missing) fails the job with internal_error,
    whose message its tenant reads (GET /jobs/{id}, /v1, webhooks) without the server's paths."""
    missing = tmp_path / "no" / "such" / "python"
    with job_in_db(tmp_path, migrated_url, {}, {"max_attempts": 1}, max_attempts=1) as (
        settings,
        sessions,
        job_id,
    ):
        runner = JobRunner(settings, sessions, lambda _: True, command=lambda run_json: [str(missing)])
        assert runner.run(job_id) == "failed"
        with session_scope(sessions) as s:
            job = jobs_db.get_job(s, job_id)
            assert job is not None and job.error_code == "internal_error"
            message = job.error_message or ""
            events = [(e.message, e.data) for e in job.events]
    assert "No such file" in message and ".../python" in message, message
    assert str(tmp_path) not in message and str(tmp_path) not in json.dumps(events)
