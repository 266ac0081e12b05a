"""Runs jobs on this worker, one attempt at a time: each step is a module of its own.

  worker.claiming     claim the next job this worker can run (fair policy) and place it on its devices
  worker.run_config   write the run config training reads (paths resolved from ids)
  worker.supervision  start the training subprocess and watch it; a SIGTERM stops it
  worker.recording    relay what it reports: progress and lease, checkpoints, samples, token statistics
  worker.outcome      judge its exit: archive and succeed, cancel, requeue, retry or fail

Redelivery is safe: the claim is a compare-and-set, so a second message for the same job does nothing.
The lease is extended on every progress tick; a stale worker's writes are refused (attempt fencing).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from core.catalog import Catalog
from core.errors import without_paths
from core.run_protocol import GradingConfig
from core.settings import Settings
from core.states import JobStatus
from core.storage import Storage
from models import jobs as jobs_db
from models.db import session_scope
from models.placement import Placer
from worker.claiming import claim_next, set_current_job
from worker.devices import detect_devices
from worker.forking import READY_TIMEOUT_S, ForkServer
from worker.outcome import Outcome
from worker.recording import Recorder
from worker.run_config import write_run_config
from worker.supervision import (
    Child,
    spawn,
    supervise,
    threads_per_run,
    training_command,
    training_env,
    training_processes,
)

log = logging.getLogger(__name__)


def worker_id() -> str:
    """This worker process's name when FTUNE_WORKER_NAME gives none: its host and a random tag, unique per
    process. Not its pid: job events name the worker to the job's tenant (JobRunner logs the pid)."""
    return f"{socket.gethostname()}-{secrets.token_hex(3)}"


class JobRunner:
    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        enqueue: Callable[[str], bool],
        command: Callable[[Path], list[str]] | None = None,
        devices: list[dict[str, Any]] | None = None,
        stopping: threading.Event | None = None,
        forks: ForkServer | None = None,
    ) -> None:
        """`command`: what starts a run, in place of training (tests). `stopping`: set when the worker
        process shuts down; a running job checkpoints, stops and goes back to the queue, and no further job
        is claimed. `forks`: a fork server to start single-process training runs from when it can."""
        self.settings = settings
        self.sessions = sessions
        self.enqueue = enqueue
        self.storage = Storage(settings.data_dir)
        self.catalog = Catalog(settings.models_dir, settings.hf_cache_dir)
        self.command = command
        self.forks = forks
        self.me = settings.worker_name or worker_id()
        log.info("worker %s is process %d", self.me, os.getpid())
        self.devices = devices if devices is not None else detect_devices(settings.worker_devices)
        self.placer = Placer(self.catalog)
        self.stopping = stopping or threading.Event()
        self.recorder = Recorder(sessions, self.storage, settings.lease_seconds)
        self.outcome = Outcome(settings, sessions, self.storage, enqueue)

    def run(self, hint: str | None = None) -> str:
        """Claim the next job this worker can run by the fair policy and run it. `hint` is the job id the
        wake-up carried: it does not decide which job runs (models.fairshare does). "skipped": none."""
        claimed = claim_next(
            self.sessions,
            settings=self.settings,
            storage=self.storage,
            placer=self.placer,
            devices=self.devices,
            worker=self.me,
        )
        if claimed is None:
            log.info("no queued job this worker can run (woken for %s); idle", hint)
            return "skipped"
        job_id, attempt = claimed
        log.info("job %s: attempt %d claimed by %s (woken for %s)", job_id, attempt, self.me, hint)
        set_current_job(self.sessions, self.me, job_id)
        try:
            run_json = write_run_config(
                self.sessions,
                storage=self.storage,
                catalog=self.catalog,
                job_id=job_id,
                grading=GradingConfig.from_settings(self.settings),
                compile_layers=self.settings.compile_layers,
            )
            return self._attempt(job_id, attempt, run_json)
        except Exception as e:
            log.exception("job %s: internal error", job_id)
            error = ("internal_error", without_paths(str(e)))  # the tenant's to read: no server path
            self.outcome.finish(job_id, attempt, JobStatus.FAILED, "internal error", error)
            return "failed"
        finally:
            set_current_job(self.sessions, self.me, None)

    def _attempt(self, job_id: str, attempt: int, run_json: Path) -> str:
        # What _start needs, read once: supervise may ask it again while a fork server starts.
        forkable = self.command is None and self.forks is not None and training_processes(run_json) == 1
        env = training_env(threads_per_run(self.settings.worker_concurrency))
        deadline = time.monotonic() + READY_TIMEOUT_S  # for a starting fork server
        rc = supervise(
            lambda: self._start(job_id, run_json, env, forkable, deadline),
            metrics_path=self.storage.metrics_path(job_id),
            interval=self.settings.progress_interval_seconds,
            started=lambda pid: self.recorder.started(job_id, attempt, pid),
            relay=lambda records: self.recorder.relay(job_id, attempt, records),
            stop_wanted=lambda: self.stopping.is_set() or self._stop_wanted(job_id),
        )
        if rc is None:
            log.warning("job %s: attempt %d lost its lease; another worker owns it now", job_id, attempt)
            return "lost"
        return self.outcome.judge(job_id, attempt, rc)

    def _start(
        self, job_id: str, run_json: Path, env: dict[str, str], forkable: bool, deadline: float
    ) -> Child | None:
        """The run in `env`: forked from the fork server where it can (`forkable`: real training, one
        process), else a fresh process. None after waiting an interval for a starting server (a fresh
        process would spend that time importing too): supervise keeps the lease and asks again, until
        `deadline`."""
        log_path = self.storage.log_path(job_id)
        if forkable and self.forks is not None:
            self.forks.start()  # a no-op while one runs, or after one declined
            if not self.forks.wait(self.settings.progress_interval_seconds) and time.monotonic() < deadline:
                return None
            forked = self.forks.fork(run_json, log_path, env)
            if forked is not None:
                log.info("job %s: training forked from the fork server (pid %d)", job_id, forked.pid)
                return forked
        return spawn((self.command or training_command)(run_json), log_path, env)

    def _stop_wanted(self, job_id: str) -> bool:
        """A pause or a cancel was asked for."""
        with session_scope(self.sessions) as s:
            return jobs_db.stop_wanted(s, job_id=job_id)
