"""Relaying what a running attempt reports (core.run_protocol records) into the database.

Progress onto the job row (which extends the lease), the "training started" event, token statistics
filled from training's start record (models.token_stats tells who else measures them), checkpoints
registered as artifacts, and evaluation samples stored as the job's samples file and events.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from core.run_protocol import CheckpointRecord, Record, SamplesRecord, StartRecord, StepRecord, read_records
from core.storage import Storage, atomic_write_text, new_id
from models import jobs as jobs_db
from models.db import session_scope
from worker.artifacts import sha256_dir
from worker.progress import progress_values, samples_document, samples_message, token_stats_from_start

log = logging.getLogger(__name__)


class Recorder:
    def __init__(self, sessions: sessionmaker[Session], storage: Storage, lease_seconds: float) -> None:
        self.sessions = sessions
        self.storage = storage
        self.lease_seconds = lease_seconds

    def started(self, job_id: str, attempt: int, pid: int) -> None:
        """The attempt's training process is running. Its pid goes to this worker's log: a job's events
        are its tenant's to read, and name no process of the server's (nor a path)."""
        log.info("job %s: attempt %d: training process %d started", job_id, attempt, pid)
        with session_scope(self.sessions) as s:
            msg = f"training process started (attempt {attempt})"
            data = {"attempt": attempt}
            jobs_db.add_event(s, job_id=job_id, kind="process_started", message=msg, data=data)

    def relay(self, job_id: str, attempt: int, records: list[Record]) -> bool:
        """Store progress and checkpoint records; extend the lease. False if the job is no longer ours."""
        progress: dict[str, Any] = {}
        with session_scope(self.sessions) as s:
            for rec in records:
                if isinstance(rec, StepRecord):
                    progress.update(progress_values(rec))
                elif isinstance(rec, StartRecord):
                    progress["total_steps"] = rec.total_steps
                    if rec.predicted_peak_bytes:  # the plan for the device this attempt runs on
                        progress["predicted_peak_bytes"] = rec.predicted_peak_bytes
                    resumed = rec.resumed_from_step
                    msg = f"training resumed from step {resumed}" if resumed else "training started"
                    data = rec.model_dump(mode="json")
                    jobs_db.add_event(s, job_id=job_id, kind="training_started", message=msg, data=data)
                    _fill_token_stats(s, job_id, rec)
                elif isinstance(rec, CheckpointRecord):
                    self._register_checkpoint(s, job_id, rec)
            if sets := [r for r in records if isinstance(r, SamplesRecord)]:
                self._store_samples(s, job_id, sets)
            lease = self.lease_seconds
            return jobs_db.heartbeat(s, job_id=job_id, attempt=attempt, lease_seconds=lease, **progress)

    def _register_checkpoint(self, s: Session, job_id: str, rec: CheckpointRecord) -> None:
        path = Path(rec.path)
        job_dir = self.storage.job_dir(job_id)
        if not path.is_dir() or job_dir not in path.parents:
            return  # pruned already, or not ours
        try:
            size, digest = sha256_dir(path)
        except FileNotFoundError:  # pruned while hashed: training keeps the newest and goes on meanwhile
            return
        relpath = path.relative_to(job_dir).as_posix()
        jobs_db.add_artifact(s, new_id(), job_id, "checkpoint", relpath, size, digest, rec.step)
        data = {"step": rec.step, "size_bytes": size}  # not rec.path: the server's, not the tenant's
        msg = f"checkpoint at step {rec.step}"
        jobs_db.add_event(s, job_id=job_id, kind="checkpoint_saved", message=msg, data=data)

    def _store_samples(self, s: Session, job_id: str, new: list[SamplesRecord]) -> None:
        """Rewrite the job's samples file from the records; an event for each new set the file did not
        hold yet (a resumed run that samples its end again replaces the set and adds no event)."""
        path = self.storage.samples_path(job_id)
        before = json.loads(path.read_text())["sets"] if path.is_file() else []
        known = {(x["step"], x["at"]) for x in before}
        atomic_write_text(path, json.dumps(samples_document(read_records(self.storage.metrics_path(job_id)))))
        for rec in new:
            if (rec.step, rec.at) in known:
                continue
            known.add((rec.step, rec.at))
            data = rec.model_dump(mode="json", exclude={"type"})
            jobs_db.add_event(s, job_id=job_id, kind="samples", message=samples_message(rec), data=data)


def _fill_token_stats(s: Session, job_id: str, rec: StartRecord) -> None:
    """If the CPU worker did not store them (none ran, timed out or failed), training's count will do."""
    job = jobs_db.get_job(s, job_id)
    stats = token_stats_from_start(rec, job.spec) if job is not None else None
    if stats is not None:
        jobs_db.fill_token_stats(s, job_id, stats)  # a no-op once they are ready
