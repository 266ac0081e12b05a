"""The end of an attempt: its exit code judged, and the job finished, requeued or retried.

Exit 0: the adapter (and a merged model) archived and registered, the job succeeded, a serving engine
told. Otherwise: cancelled if a cancel was asked for; requeued (or paused) after a stop; retried while
attempts are left and the error is one a retry can mend (NO_RETRY_CODES are not); else failed. Every
status change is one compare-and-set (models.jobs.finish): an attempt that lost the job changes nothing.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from core.errors import without_paths
from core.run_protocol import EXIT_STOPPED, read_error
from core.settings import Settings
from core.states import JobStatus
from core.storage import MERGED_DIR, Storage, new_id
from models import jobs as jobs_db
from models.db import session_scope
from worker.artifacts import build_adapter_archive, build_archive, sha256_file
from worker.serving import announce_adapter

log = logging.getLogger(__name__)

# A retry would only fail again: out of memory on the same plan, the same data, the same files allowance.
NO_RETRY_CODES = {"out_of_memory", "invalid_dataset", "invalid_spec", "storage_quota_exceeded"}


class Outcome:
    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        storage: Storage,
        enqueue: Callable[[str], bool],
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.storage = storage
        self.enqueue = enqueue

    def judge(self, job_id: str, attempt: int, rc: int) -> str:
        """Record the attempt's end from its exit code; returns the outcome (for the task's log)."""
        if rc == 0:
            self._archive(job_id)
            self.finish(job_id, attempt, JobStatus.SUCCEEDED, "training finished; adapter ready")
            with self.sessions() as s:
                job = jobs_db.get_job(s, job_id)
            if job is not None and job.status == JobStatus.SUCCEEDED:
                announce_adapter(self.settings, self.storage, job)
            return "succeeded"
        if self._cancel_requested(job_id):
            # Also when the stop signal arrived before training installed its handler (it dies of
            # SIGTERM): a retry would leave the job queued with cancel_requested, which no claim takes.
            how = "checkpoint saved" if rc == EXIT_STOPPED else "stopped before training started"
            self.finish(job_id, attempt, JobStatus.CANCELLED, f"cancelled; {how}")
            return "cancelled"
        if rc == EXIT_STOPPED:  # a pause, or this worker is shutting down
            paused = "paused; checkpoint saved, a resume continues from it"
            to = self.finish(
                job_id, attempt, JobStatus.QUEUED, "worker shutting down; will resume later", None, paused
            )
            return self._requeued(job_id, to, "requeued")
        code, message = self._read_error(job_id, rc)
        if code == "out_of_memory":
            message += self._memory_note(job_id)
        if code not in NO_RETRY_CODES and self._attempts_left(job_id, attempt):
            to = self.finish(
                job_id, attempt, JobStatus.QUEUED, f"attempt {attempt} failed ({message}); retrying"
            )
            return self._requeued(job_id, to, "retrying")
        self.finish(job_id, attempt, JobStatus.FAILED, message, (code, message))
        return "failed"

    def finish(
        self,
        job_id: str,
        attempt: int,
        status: JobStatus,
        message: str,
        error: tuple[str, str] | None = None,
        paused_message: str | None = None,
    ) -> JobStatus | None:
        """Move the job to `status` if this attempt still owns it; returns the status it reached (a stop
        of a job asked to pause reaches PAUSED), None when another attempt owns it now."""
        with session_scope(self.sessions) as s:
            to = jobs_db.finish(
                s,
                job_id=job_id,
                attempt=attempt,
                dst=status,
                message=message,
                error=error,
                paused_message=paused_message,
            )
            if to is None:
                log.warning(
                    "job %s: attempt %d no longer owns the job; outcome %s dropped", job_id, attempt, status
                )
                return None
            if to == JobStatus.QUEUED:
                jobs_db.mark_enqueued(s, job_id=job_id)
        log.info(
            "job %s: %s (%s)", job_id, to, paused_message if to != status and paused_message else message
        )
        return to

    def _archive(self, job_id: str) -> None:
        """The adapter's archive (and the merged model's, export: merged), registered as artifacts."""
        job_dir = self.storage.job_dir(job_id)
        archives = {"adapter": build_adapter_archive(job_dir)}
        if (job_dir / MERGED_DIR).is_dir():  # export: merged
            archives["merged"] = build_archive(job_dir / MERGED_DIR, self.storage.merged_archive(job_id))
        with session_scope(self.sessions) as s:
            for kind, archive in archives.items():
                size, digest = archive.stat().st_size, sha256_file(archive)
                jobs_db.add_artifact(s, new_id(), job_id, kind, archive.name, size, digest, None)

    def _requeued(self, job_id: str, to: JobStatus | None, outcome: str) -> str:
        """Wake a worker (after the commit) for a job back in the queue; a paused one waits for a resume."""
        if to == JobStatus.QUEUED:
            self.enqueue(job_id)
            return outcome
        return "paused" if to == JobStatus.PAUSED else "lost"

    def _cancel_requested(self, job_id: str) -> bool:
        with session_scope(self.sessions) as s:
            return jobs_db.cancel_requested(s, job_id=job_id)

    def _memory_note(self, job_id: str) -> str:
        """The planner's prediction beside the measured peak, so an OOM says how far off the plan was."""
        with session_scope(self.sessions) as s:
            job = jobs_db.get_job(s, job_id)
            predicted = job.predicted_peak_bytes if job else None
            measured = job.peak_mem_bytes if job else None
        gib = 2**30
        parts = [f"planner predicted {predicted / gib:.2f} GiB" if predicted else "no planner prediction"]
        if measured:
            parts.append(f"measured peak before the failure {measured / gib:.2f} GiB")
        return f" ({'; '.join(parts)})"

    def _attempts_left(self, job_id: str, attempt: int) -> bool:
        with session_scope(self.sessions) as s:
            job = jobs_db.get_job(s, job_id)
            return job is not None and attempt < job.max_attempts

    def _read_error(self, job_id: str, rc: int) -> tuple[str, str]:
        """The attempt's error as its tenant sees it: no server paths (the log keeps the message whole)."""
        error = read_error(self.storage.error_path(job_id))
        if error is not None:
            code, message = error
            shown = without_paths(message)
            if shown != message:
                log.warning("job %s: %s: %s", job_id, code, message)
            return code, shown
        if rc < 0:
            name = signal.Signals(-rc).name
            hint = " (the kernel's out-of-memory killer sends SIGKILL)" if rc == -signal.SIGKILL else ""
            return "training_killed", f"training process was killed by {name}{hint}"
        return "training_error", f"training process exited with code {rc}; see the job log"
