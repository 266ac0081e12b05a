"""JobRunner outcomes on a real database with a real (stand-in) training subprocess.

The training command is injected: a few lines of Python that behave like `training.run` at its
exit (error.json + exit code), so the runner's handling is tested without training a model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from models import jobs as jobs_db
from models.db import session_scope
from tests.worker.runner_env import job_in_db, stand_in_training
from worker.runner import JobRunner

GIB = 2**30


def _exit_with_error(code: str, message: str, rc: int):  # type: ignore[no-untyped-def]
    error = f"{{'code': {code!r}, 'message': {message!r}}}"
    return stand_in_training(f"(out / 'error.json').write_text(json.dumps({error})); sys.exit({rc})")


@pytest.fixture
def runner_env(tmp_path: Path, migrated_url: str):  # type: ignore[no-untyped-def]
    with job_in_db(
        tmp_path, migrated_url, {}, {"max_attempts": 3}, predicted_peak_bytes=3 * GIB, max_attempts=3
    ) as env:
        yield env


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
        # the prediction the job ran under: re-planned on this worker at its claim (the admission's kept)
        placed = [e for e in job.events if e.kind == "placed"]
        assert len(placed) == 1 and placed[0].data["admission_predicted_bytes"] == 3 * 2**30
        assert job.predicted_peak_bytes == placed[0].data["predicted_bytes"] != 3 * 2**30
        assert f"planner predicted {job.predicted_peak_bytes / 2**30:.2f} GiB" in (job.error_message or "")


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
