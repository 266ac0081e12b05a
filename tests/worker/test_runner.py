"""JobRunner outcomes on a real database with a real (stand-in) training subprocess.

The training command is injected: a few lines of Python that behave like `training.run` at its
exit (error.json + exit code), so the runner's handling is tested without training a model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from core.settings import Settings
from core.spec import JobSpec
from core.storage import new_id
from models import datasets as datasets_db
from models import jobs as jobs_db
from models.db import make_engine, make_session_factory, session_scope
from models.tenants import get_or_create_tenant
from worker.runner import JobRunner

GIB = 2**30


def _exit_with_error(code: str, message: str, rc: int):  # type: ignore[no-untyped-def]
    def command(run_json: Path) -> list[str]:
        script = (
            "import json, pathlib, sys; "
            "out = pathlib.Path(json.loads(pathlib.Path(sys.argv[1]).read_text())['output_dir']); "
            "out.mkdir(parents=True, exist_ok=True); "
            f"(out / 'error.json').write_text(json.dumps({{'code': {code!r}, 'message': {message!r}}})); "
            f"sys.exit({rc})"
        )
        return [sys.executable, "-c", script, str(run_json)]

    return command


@pytest.fixture
def runner_env(tmp_path: Path, migrated_url: str):  # type: ignore[no-untyped-def]
    models_dir = tmp_path / "models"
    (models_dir / "tiny").mkdir(parents=True)
    (models_dir / "tiny" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    settings = Settings(
        data_dir=tmp_path / "data",
        models_dir=models_dir,
        database_url=migrated_url,
        progress_interval_seconds=0.05,
        max_attempts=3,
    )
    engine = make_engine(migrated_url)
    sessions = make_session_factory(engine)
    with session_scope(sessions) as s:
        tenant = get_or_create_tenant(s, "acme")
        dataset_id = new_id()
        report = {"valid": True, "format": "text", "num_examples": 1, "size_bytes": 10, "sha256": "0" * 64}
        datasets_db.create_dataset(s, tenant.id, dataset_id, "d.jsonl", report)
        job_id = new_id()
        spec = JobSpec(base_model="tiny", dataset_id=dataset_id)
        jobs_db.create_job(s, tenant.id, job_id, spec, predicted_peak_bytes=3 * GIB, max_attempts=3)
    yield settings, sessions, job_id
    engine.dispose()


def test_out_of_memory_fails_at_once_with_the_planners_prediction(runner_env) -> None:  # type: ignore[no-untyped-def]
    settings, sessions, job_id = runner_env
    enqueued: list[str] = []
    runner = JobRunner(
        settings, sessions, enqueued.append, command=_exit_with_error("out_of_memory", "out of memory", 1)
    )
    assert runner.run(job_id) == "failed"
    assert enqueued == []  # an OOM would only fail again: no retry
    with session_scope(sessions) as s:
        job = jobs_db.get_job(s, job_id)
        assert job is not None
        assert job.status == "failed" and job.attempt == 1
        assert job.error_code == "out_of_memory"
        assert "planner predicted 3.00 GiB" in (job.error_message or "")


def test_a_crash_is_retried_until_max_attempts(runner_env) -> None:  # type: ignore[no-untyped-def]
    settings, sessions, job_id = runner_env
    enqueued: list[str] = []
    runner = JobRunner(
        settings, sessions, enqueued.append, command=_exit_with_error("training_error", "boom", 1)
    )
    outcomes = [runner.run(job_id) for _ in range(3)]
    assert outcomes == ["retrying", "retrying", "failed"]
    assert enqueued == [job_id, job_id]
    with session_scope(sessions) as s:
        job = jobs_db.get_job(s, job_id)
        assert job is not None and job.status == "failed" and job.error_code == "training_error"
        kinds = [e.kind for e in jobs_db.list_events(s, job_id, 0, 100)[0]]
    assert kinds.count("started") == 3 and kinds[-1] == "failed"
