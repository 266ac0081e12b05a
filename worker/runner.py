"""Runs one job: claim it, launch training in a subprocess, relay progress, record the outcome.

Redelivery is safe: the claim is a compare-and-set, so a second message for the same job does nothing.
The lease is extended on every progress tick; a stale worker's writes are refused (attempt fencing).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from sqlalchemy.orm import Session, sessionmaker

from core.catalog import Catalog
from core.process import child_env
from core.run_protocol import (
    EXIT_STOPPED,
    CheckpointRecord,
    Record,
    RecordTail,
    RunConfig,
    SamplesRecord,
    StartRecord,
    StepRecord,
    StoppedRecord,
    read_error,
    read_records,
)
from core.settings import Settings
from core.spec import JobSpec
from core.states import JobStatus
from core.storage import MERGED_DIR, Storage, atomic_write_text, new_id
from models import datasets as datasets_db
from models import fairshare, openai_jobs
from models import jobs as jobs_db
from models import workers as workers_db
from models.db import session_scope
from models.placement import Placer
from models.tables import Job
from worker.artifacts import build_adapter_archive, build_archive, sha256_dir, sha256_file
from worker.devices import detect_devices
from worker.progress import progress_values, samples_document, samples_message, token_stats_from_start
from worker.serving import announce_adapter

log = logging.getLogger(__name__)

# torchrun forwards our SIGTERM to its ranks and SIGKILLs them after this long (its default is 30 s):
# enough for the step in flight and a checkpoint.
SHUTDOWN_TIMEOUT_S = 600
NO_RETRY_CODES = {"out_of_memory", "invalid_dataset", "invalid_spec"}

# Set when the worker process is shutting down: running jobs checkpoint, stop and go back to the queue.
shutting_down = threading.Event()


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class JobRunner:
    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        enqueue: Callable[[str], bool],
        command: Callable[[Path], list[str]] | None = None,
        devices: list[dict[str, Any]] | None = None,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.enqueue = enqueue
        self.storage = Storage(settings.data_dir)
        self.catalog = Catalog(settings.models_dir, settings.hf_cache_dir)
        self.command = command or training_command
        self.me = settings.worker_name or worker_id()
        self.devices = devices if devices is not None else detect_devices(settings.worker_devices)
        self.placer = Placer(self.catalog)

    def run(self, hint: str | None = None) -> str:
        """Claim the next job this worker can run by the fair policy and run it. `hint` is the job id the
        wake-up carried: it does not decide which job runs (models.fairshare does). "skipped": none."""
        with session_scope(self.sessions) as s:
            claimed = fairshare.claim_next(
                s,
                can_run=lambda job: self.placer.fits(job, self.devices),
                worker_id=self.me,
                lease_seconds=self.settings.lease_seconds,
                running_limit=self.settings.max_running_jobs_per_tenant,
            )
            if claimed is not None:
                self._record_placement(s, claimed[0], claimed[1])
        if claimed is None:
            log.info("no queued job this worker can run (woken for %s); idle", hint)
            return "skipped"
        job_id, attempt = claimed[0].id, claimed[1]
        log.info("job %s: attempt %d claimed by %s (woken for %s)", job_id, attempt, self.me, hint)
        self._set_current_job(job_id)
        try:
            run_json = self._write_run_config(job_id)
            return self._supervise(job_id, attempt, run_json)
        except Exception as e:
            log.exception("job %s: internal error", job_id)
            self._finish(job_id, attempt, JobStatus.FAILED, "internal error", ("internal_error", str(e)))
            return "failed"
        finally:
            self._set_current_job(None)

    def _record_placement(self, s: Session, job: Job, attempt: int) -> None:
        """The plan re-made on this worker's devices is the one the job runs under: plan.json and the
        prediction shown beside the measured peak are replaced, the event keeps both."""
        verdict = self.placer.verdict(job, self.devices)
        data: dict[str, Any] = {"worker": self.me, "devices": self.devices, "attempt": attempt}
        data["admission_predicted_bytes"] = job.predicted_peak_bytes
        plan = verdict.plan
        if plan is not None:
            atomic_write_text(self.storage.plan_path(job.id), plan.model_dump_json())
            jobs_db.set_predicted_peak(s, job_id=job.id, predicted_peak_bytes=plan.allocated_bytes)
            data |= {
                "device": plan.gpu,
                "predicted_bytes": plan.allocated_bytes,
                "plan_total": plan.total_bytes,
            }
        where = f" on {plan.gpu}: plan {plan.total_bytes / 2**30:.2f} GiB" if plan else " (no plan)"
        msg = f"placed on {self.me}{where}"
        jobs_db.add_event(s, job_id=job.id, kind="placed", message=msg, data=data)

    def _set_current_job(self, job_id: str | None) -> None:
        with session_scope(self.sessions) as s:
            workers_db.set_current_job(s, self.me, job_id)

    def _write_run_config(self, job_id: str) -> Path:
        with session_scope(self.sessions) as s:
            job = jobs_db.get_job(s, job_id)
            assert job is not None
            spec = JobSpec.model_validate(job.spec)
            mapping = _column_mapping(s, spec.dataset_id)
            val_mapping = _column_mapping(s, spec.validation_dataset_id)
            init_dir = self._init_adapter_dir(s, spec)
        model = self.catalog.get(spec.base_model)
        config = RunConfig(
            job_id=job_id,
            spec=spec,
            model_dir=str(model.path),
            dataset_path=str(self.storage.dataset_path(spec.dataset_id)),
            output_dir=str(self.storage.job_dir(job_id)),
            column_mapping=mapping,
            validation_path=(
                str(self.storage.dataset_path(spec.validation_dataset_id))
                if spec.validation_dataset_id
                else None
            ),
            validation_column_mapping=val_mapping,
            # spec.init_from: the earlier job's adapter (admission checked its tenant, status and base)
            init_adapter_dir=str(init_dir) if init_dir else None,
        )
        path = self.storage.run_config_path(job_id)
        atomic_write_text(path, config.model_dump_json(indent=2))
        self.storage.error_path(job_id).unlink(missing_ok=True)  # from an earlier attempt
        return path

    def _init_adapter_dir(self, s: Session, spec: JobSpec) -> Path | None:
        """spec.init_from's final adapter, or (init_from_step) its checkpoint at that step, as recorded when
        it was saved; admission checked the job's tenant, status and base, and that the checkpoint exists."""
        if spec.init_from is None:
            return None
        if spec.init_from_step is None:
            return self.storage.adapter_dir(spec.init_from)
        saved = openai_jobs.checkpoint(s, spec.init_from, spec.init_from_step)
        if saved is None:
            raise FileNotFoundError(f"job {spec.init_from} has no checkpoint at step {spec.init_from_step}")
        return self.storage.job_dir(spec.init_from) / saved.relpath

    def _supervise(self, job_id: str, attempt: int, run_json: Path) -> str:
        tail = RecordTail(self.storage.metrics_path(job_id))
        tail.read_new()  # skip records of earlier attempts
        with self.storage.log_path(job_id).open("ab") as logf:
            proc = spawn(self.command(run_json), logf)
        with session_scope(self.sessions) as s:
            msg = f"training process {proc.pid} started"
            data = {"pid": proc.pid, "attempt": attempt}
            jobs_db.add_event(s, job_id=job_id, kind="process_started", message=msg, data=data)
        stop_sent = False
        owned = True
        stopped = False  # torchrun exits 1 whatever its ranks return, so a stop is read from the metrics
        while proc.poll() is None:
            time.sleep(self.settings.progress_interval_seconds)
            records = tail.read_new()
            stopped = stopped or any(isinstance(r, StoppedRecord) for r in records)
            owned = self._relay(job_id, attempt, records)
            if not stop_sent and (not owned or shutting_down.is_set() or self._stop_wanted(job_id)):
                proc.send_signal(signal.SIGTERM)
                stop_sent = True
        records = tail.read_new()
        stopped = stopped or any(isinstance(r, StoppedRecord) for r in records)
        owned = self._relay(job_id, attempt, records) and owned
        if not owned:
            log.warning("job %s: attempt %d lost its lease; another worker owns it now", job_id, attempt)
            return "lost"
        rc = proc.returncode
        return self._outcome(job_id, attempt, EXIT_STOPPED if stopped and rc != 0 else rc)

    def _stop_wanted(self, job_id: str) -> bool:
        with session_scope(self.sessions) as s:
            return jobs_db.stop_wanted(s, job_id=job_id)

    def _cancel_requested(self, job_id: str) -> bool:
        with session_scope(self.sessions) as s:
            return jobs_db.cancel_requested(s, job_id=job_id)

    def _relay(self, job_id: str, attempt: int, records: list[Record]) -> bool:
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
                    self._fill_token_stats(s, job_id, rec)
                elif isinstance(rec, CheckpointRecord):
                    self._register_checkpoint(s, job_id, rec)
            if sets := [r for r in records if isinstance(r, SamplesRecord)]:
                self._store_samples(s, job_id, sets)
            lease = self.settings.lease_seconds
            return jobs_db.heartbeat(s, job_id=job_id, attempt=attempt, lease_seconds=lease, **progress)

    def _fill_token_stats(self, s: Session, job_id: str, rec: StartRecord) -> None:
        """If the CPU worker did not store them (none ran, timed out or failed), training's count will do."""
        job = jobs_db.get_job(s, job_id)
        stats = token_stats_from_start(rec, job.spec) if job is not None else None
        if stats is not None:
            jobs_db.fill_token_stats(s, job_id, stats)  # a no-op once they are ready

    def _register_checkpoint(self, s: Session, job_id: str, rec: CheckpointRecord) -> None:
        path = Path(rec.path)
        job_dir = self.storage.job_dir(job_id)
        if not path.is_dir() or job_dir not in path.parents:
            return  # pruned already, or not ours
        size, digest = sha256_dir(path)
        relpath = path.relative_to(job_dir).as_posix()
        jobs_db.add_artifact(s, new_id(), job_id, "checkpoint", relpath, size, digest, rec.step)
        data = rec.model_dump(mode="json")
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

    def _outcome(self, job_id: str, attempt: int, rc: int) -> str:
        if rc == 0:
            job_dir = self.storage.job_dir(job_id)
            archives = {"adapter": build_adapter_archive(job_dir)}
            if (job_dir / MERGED_DIR).is_dir():  # export: merged
                archives["merged"] = build_archive(job_dir / MERGED_DIR, self.storage.merged_archive(job_id))
            with session_scope(self.sessions) as s:
                for kind, archive in archives.items():
                    size, digest = archive.stat().st_size, sha256_file(archive)
                    jobs_db.add_artifact(s, new_id(), job_id, kind, archive.name, size, digest, None)
            self._finish(job_id, attempt, JobStatus.SUCCEEDED, "training finished; adapter ready")
            with self.sessions() as s:
                job = jobs_db.get_job(s, job_id)
            if job is not None and job.status == JobStatus.SUCCEEDED:
                announce_adapter(self.settings, self.storage, job)
            return "succeeded"
        if rc != 0 and self._cancel_requested(job_id):
            # Also when the stop signal arrived before training installed its handler (it dies of
            # SIGTERM): a retry would leave the job queued with cancel_requested, which no claim takes.
            how = "checkpoint saved" if rc == EXIT_STOPPED else "stopped before training started"
            self._finish(job_id, attempt, JobStatus.CANCELLED, f"cancelled; {how}")
            return "cancelled"
        if rc == EXIT_STOPPED:  # a pause, or this worker is shutting down
            paused = "paused; checkpoint saved, a resume continues from it"
            to = self._finish(
                job_id, attempt, JobStatus.QUEUED, "worker shutting down; will resume later", None, paused
            )
            return self._requeued(job_id, to, "requeued")
        code, message = self._read_error(job_id, rc)
        if code == "out_of_memory":
            message += self._memory_note(job_id)
        if code not in NO_RETRY_CODES and self._attempts_left(job_id, attempt):
            to = self._finish(
                job_id, attempt, JobStatus.QUEUED, f"attempt {attempt} failed ({message}); retrying"
            )
            return self._requeued(job_id, to, "retrying")
        self._finish(job_id, attempt, JobStatus.FAILED, message, (code, message))
        return "failed"

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
        error = read_error(self.storage.error_path(job_id))
        if error is not None:
            return error
        if rc < 0:
            name = signal.Signals(-rc).name
            hint = " (the kernel's out-of-memory killer sends SIGKILL)" if rc == -signal.SIGKILL else ""
            return "training_killed", f"training process was killed by {name}{hint}"
        return "training_error", f"training process exited with code {rc}; see the job log"

    def _finish(
        self,
        job_id: str,
        attempt: int,
        status: JobStatus,
        message: str,
        error: tuple[str, str] | None = None,
        paused_message: str | None = None,
    ) -> JobStatus | None:
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

    def _requeued(self, job_id: str, to: JobStatus | None, outcome: str) -> str:
        """Wake a worker (after the commit) for a job back in the queue; a paused one waits for a resume."""
        if to == JobStatus.QUEUED:
            self.enqueue(job_id)
            return outcome
        return "paused" if to == JobStatus.PAUSED else "lost"


def _column_mapping(s: Session, dataset_id: str | None) -> dict[str, str] | None:
    """The column mapping a dataset was uploaded with (its rows are read through it)."""
    dataset = datasets_db.get_dataset(s, dataset_id) if dataset_id else None
    return dataset.report.get("column_mapping") if dataset else None


def spawn(command: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    """Start a child of this worker. No preexec_fn (not fork-safe in a threaded worker): the child stops
    itself when this process ends (core.process.stop_with_worker, told our pid by child_env)."""
    return subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a Ctrl-C on the terminal reaches us, not the trainer
        env=child_env(PYTHONUNBUFFERED="1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT=str(SHUTDOWN_TIMEOUT_S)),
    )


def training_command(run_json: Path) -> list[str]:
    """One process, or with num_gpus > 1 one FSDP rank per device under torchrun (gloo ranks on a CPU)."""
    n = RunConfig.model_validate_json(run_json.read_text()).spec.num_gpus
    if n == 1:
        return [sys.executable, "-m", "training.run", str(run_json)]
    # --standalone: a private rendezvous on a free port, so jobs on one machine do not collide.
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
    return [*launcher, "-m", "training.run", str(run_json)]
