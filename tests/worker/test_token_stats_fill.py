"""Training's "start" record fills a job's token statistics the CPU worker did not store (none ran, it
timed out or failed), and never replaces ready ones. The training command is a stand-in script."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from models import jobs as jobs_db
from models.db import session_scope
from tests.worker.runner_env import job_in_db, stand_in_training
from worker.runner import JobRunner

START = {
    "type": "start",
    "total_steps": 3,
    "num_examples": 3,
    "dropped_examples": 1,
    "resumed_from_step": 0,
    "token_stats": {
        "count": 4,
        "p50": 10,
        "p95": 70,
        "max": 70,
        "over_max_seq_len": 1,
        "over_length": "drop",
    },
}


# Writes the start record, then fails as training does on bad data (no retry).
_start_then_fail = stand_in_training(
    f"(out / 'metrics.jsonl').open('a').write(json.dumps({START!r}) + '\\n'); "
    "(out / 'error.json').write_text(json.dumps({'code': 'invalid_dataset', 'message': 'x'})); "
    "sys.exit(1)"
)


@pytest.fixture
def runner_env(tmp_path: Path, migrated_url: str):  # type: ignore[no-untyped-def]
    spec = {"max_seq_len": 64, "over_length": "drop"}
    with job_in_db(tmp_path, migrated_url, spec) as (settings, sessions, job_id):
        yield JobRunner(settings, sessions, lambda _: True, command=_start_then_fail), sessions, job_id


def _job(sessions, job_id: str) -> tuple[dict[str, Any], list[str]]:  # type: ignore[no-untyped-def]
    with sessions() as s:
        job = jobs_db.get_job(s, job_id)
        events, _ = jobs_db.list_events(s, job_id, 0, 100)
        return job.token_stats, [e.message for e in events if e.kind == "token_stats"]


def test_pending_stats_are_filled_from_the_start_record(runner_env) -> None:  # type: ignore[no-untyped-def]
    runner, sessions, job_id = runner_env
    assert runner.run(job_id) == "failed"
    stats, messages = _job(sessions, job_id)
    # The micro-batch figures are the API's alone; max_seq_len and packing come from the job's spec.
    assert stats == {
        **START["token_stats"],
        **{"status": "ready", "source": "training_start", "dropped": 1, "max_seq_len": 64, "packing": True},
    }
    assert messages == [
        "warning: token statistics: 4 examples, p50 10 / p95 70 / max 70 tokens; "
        "1 exceed max_seq_len 64 and will be dropped"
    ]


def test_ready_stats_are_kept(runner_env) -> None:  # type: ignore[no-untyped-def]
    runner, sessions, job_id = runner_env
    computed = {**START["token_stats"], "status": "ready", "source": "job_created", "dropped": 1}
    computed |= {"max_seq_len": 64, "steps_per_epoch": 2, "micro_batches_per_epoch": 2}
    with session_scope(sessions) as s:
        assert jobs_db.store_token_stats(s, job_id, computed)
    runner.run(job_id)
    stats, messages = _job(sessions, job_id)
    assert stats["source"] == "job_created" and stats["steps_per_epoch"] == 2
    assert len(messages) == 1
