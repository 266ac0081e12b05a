"""The `ftune.token_stats` task's work on a real database: the request resolved from the job id alone,
stored once, a redelivered message and a shutdown change nothing. The computation is a small double;
the real subprocess on a real worker runs in tests/api/test_token_stats.py."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from core.catalog import Catalog
from core.storage import Storage
from models import jobs as jobs_db
from models.db import session_scope
from models.tables import Dataset, Job
from tests.worker.runner_env import job_in_db
from worker.token_stats import StatsRequest, compute_and_store

MAPPING = {"question": "prompt", "answer": "completion"}
READY = {"status": "ready", "count": 4, "p50": 10, "p95": 12, "max": 12, "over_max_seq_len": 0}


class Recording:
    def __init__(self, result: dict[str, Any] | None = READY) -> None:
        self.result = result
        self.requests: list[StatsRequest] = []

    def __call__(self, request: StatsRequest, stop: threading.Event) -> dict[str, Any] | None:
        self.requests.append(request)
        return self.result


@pytest.fixture
def env(tmp_path: Path, migrated_url: str):  # type: ignore[no-untyped-def]
    with job_in_db(tmp_path, migrated_url, {"max_seq_len": 64}) as (settings, sessions, job_id):
        with session_scope(sessions) as s:
            job = s.get(Job, job_id)
            assert job is not None
            dataset = s.get(Dataset, job.dataset_id)
            assert dataset is not None
            dataset.report = {**dataset.report, "column_mapping": MAPPING}
        deps = {
            "catalog": Catalog(settings.models_dir, None),
            "storage": Storage(settings.data_dir),
            "stop": threading.Event(),
        }
        yield settings, sessions, job_id, deps


def _stats(sessions, job_id: str) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    with sessions() as s:
        return dict(jobs_db.get_job(s, job_id).token_stats)


def test_the_request_is_resolved_from_the_job_id(env) -> None:  # type: ignore[no-untyped-def]
    settings, sessions, job_id, deps = env
    compute = Recording()
    assert compute_and_store(sessions, compute=compute, job_id=job_id, **deps) == "ready"
    (req,) = compute.requests
    with sessions() as s:
        job = jobs_db.get_job(s, job_id)
        assert job is not None
        dataset_id = job.dataset_id
    assert req.job_id == job_id and req.column_mapping == MAPPING
    assert req.model_dir == settings.models_dir / "tiny"
    assert req.dataset_path == settings.data_dir / "datasets" / f"{dataset_id}.jsonl"
    assert '"max_seq_len":64' in req.spec_json
    assert _stats(sessions, job_id)["status"] == "ready"


def test_a_redelivered_message_computes_nothing(env) -> None:  # type: ignore[no-untyped-def]
    _, sessions, job_id, deps = env
    compute = Recording()
    assert compute_and_store(sessions, compute=compute, job_id=job_id, **deps) == "ready"
    assert compute_and_store(sessions, compute=compute, job_id=job_id, **deps) == "skipped"
    assert compute_and_store(sessions, compute=compute, job_id="0" * 32, **deps) == "skipped"  # no such job
    assert len(compute.requests) == 1
    with sessions() as s:
        kinds = [e.kind for e in jobs_db.list_events(s, job_id, 0, 100)[0]]
    assert kinds.count("token_stats") == 1


def test_a_shutdown_stores_nothing_and_training_fills_them_later(env) -> None:  # type: ignore[no-untyped-def]
    _, sessions, job_id, deps = env
    assert compute_and_store(sessions, compute=Recording(None), job_id=job_id, **deps) == "stopped"
    assert _stats(sessions, job_id) == {"status": "pending"}


def test_a_failing_computation_is_stored_as_failed(env) -> None:  # type: ignore[no-untyped-def]
    _, sessions, job_id, deps = env

    def broken(request: StatsRequest, stop: threading.Event) -> dict[str, Any] | None:
        raise RuntimeError("a bug")

    assert compute_and_store(sessions, compute=broken, job_id=job_id, **deps) == "failed"
    assert _stats(sessions, job_id)["error"]["code"] == "token_stats_error"


def test_a_base_model_removed_after_admission_fails_clearly(env) -> None:  # type: ignore[no-untyped-def]
    settings, sessions, job_id, deps = env
    (settings.models_dir / "tiny" / "config.json").unlink()
    (settings.models_dir / "tiny").rmdir()
    assert compute_and_store(sessions, compute=Recording(), job_id=job_id, **deps) == "failed"
    assert _stats(sessions, job_id)["error"]["code"] == "model_not_found"
