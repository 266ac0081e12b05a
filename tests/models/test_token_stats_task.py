"""The `ftune.token_stats` task's work on a real database: the request resolved from the job id alone,
stored once, a redelivered message and a shutdown change nothing. The computation is a small double;
the real subprocess on a real worker runs in tests/api/test_token_stats.py."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from core.arch import load_architecture
from core.catalog import Catalog
from core.data.token_stats import StatsRequest
from core.spec import JobSpec
from core.storage import Storage
from models import jobs as jobs_db
from models.db import session_scope
from models.tables import Dataset, Job
from models.token_stats import compute_and_store
from planner import BatchShape, Plan
from planner.feasibility import plan_on
from planner.gpus import resolve_gpu
from tests.worker.runner_env import job_in_db

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


def test_ready_statistics_replan_the_job_from_its_data(env) -> None:  # type: ignore[no-untyped-def]
    """Admission planned every micro-batch max_seq_len tokens; the statistics' largest micro-batch makes
    a smaller plan, recorded beside the admission plan (admission-plan.json is not touched)."""
    settings, sessions, job_id, deps = env
    storage: Storage = deps["storage"]
    admitted = storage.admission_plan_path(job_id)
    admitted.parent.mkdir(parents=True, exist_ok=True)
    admitted.write_text("{}")
    shape = BatchShape(tokens=24, seq_len=12, targets=10)
    compute = Recording({**READY, **shape.token_stats()})
    assert compute_and_store(sessions, compute=compute, job_id=job_id, plan_gpu="T4", **deps) == "replanned"

    plan = Plan.model_validate_json(storage.plan_path(job_id).read_text())
    assert plan.batch_shape == shape and plan.planned_tokens == 24 and plan.gpu == "T4"
    with sessions() as s:
        job = jobs_db.get_job(s, job_id)
        assert job is not None
        spec = JobSpec.model_validate(job.spec)
        (event,) = [e for e in jobs_db.list_events(s, job_id, 0, 100)[0] if e.kind == "replanned"]
        assert job.predicted_peak_bytes == plan.allocated_bytes
    worst = plan_on(spec, load_architecture(settings.models_dir / "tiny"), resolve_gpu("T4"))
    assert worst.planned_tokens == spec.micro_batch_size * 64 > plan.planned_tokens
    assert plan.allocated_bytes <= worst.allocated_bytes  # (a tiny model: the optimizer step is its peak)
    assert event.data["predicted_bytes"] == plan.allocated_bytes
    assert event.data["batch_shape"] == shape.model_dump()
    assert "re-planned from the data's largest micro-batch: 24 tokens" in event.message
    assert admitted.read_text() == "{}"


def test_statistics_without_a_shape_or_a_device_do_not_replan(env) -> None:  # type: ignore[no-untyped-def]
    _, sessions, job_id, deps = env
    assert compute_and_store(sessions, compute=Recording(), job_id=job_id, plan_gpu="T4", **deps) == "ready"
    assert not deps["storage"].plan_path(job_id).exists()
