"""The job's files allowance reaches training, and a run that would pass it fails the job at once: a
JobRunner on a real database, its training a stand-in that reads run.json and exits as training.run does
when a checkpoint would not fit (error.json storage_quota_exceeded, exit 1)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import update

from models import jobs as jobs_db
from models.db import session_scope
from models.tables import Job
from tests.worker.runner_env import job_in_db, stand_in_training
from worker.runner import JobRunner

OVER = stand_in_training(
    "allowance = json.loads(pathlib.Path(sys.argv[1]).read_text())['files_allowance_bytes']; "
    "message = f'the checkpoint at step 2 would take 9 bytes; {allowance} bytes reserved'; "
    "(out / 'error.json').write_text(json.dumps({'code': 'storage_quota_exceeded', 'message': message})); "
    "sys.exit(1)"
)


def test_a_run_past_its_allowance_fails_the_job_without_a_retry(tmp_path: Path, migrated_url: str) -> None:
    with job_in_db(tmp_path, migrated_url, {}, {"max_attempts": 3}, max_attempts=3) as (
        settings,
        sessions,
        job_id,
    ):
        with session_scope(sessions) as s:
            s.execute(update(Job).where(Job.id == job_id).values(files_allowance_bytes=123_456))
        enqueued: list[str] = []

        def wake(job: str) -> bool:
            enqueued.append(job)
            return True

        assert JobRunner(settings, sessions, wake, command=OVER).run(job_id) == "failed"
        assert enqueued == []  # a retry would pass it again
        with session_scope(sessions) as s:
            job = jobs_db.get_job(s, job_id)
            assert job is not None and job.status == "failed" and job.attempt == 1
            assert job.error_code == "storage_quota_exceeded"
            assert "123456 bytes reserved" in (job.error_message or "")  # run.json carried the row's
