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

import functools
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
from worker.nodes import Node, keep_node, my_node, release_nodes, reserved_node, wake_peers
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
        wake_on: Callable[[str, str], bool] | None = None,
    ) -> None:
        """`command`: what starts a run, in place of training (tests). `stopping`: set when the worker
        process shuts down; a running job checkpoints, stops and goes back to the queue, and no further job
        is claimed. `forks`: a fork server to start single-process training runs from when it can.
        `wake_on(queue, job id)`: publishes a wake-up on a queue (core.queues.Enqueuer.to); the other
        nodes of a multi-node job placed here are woken with it (None: they start on their tick)."""
        self.settings = settings
        self.sessions = sessions
        self.enqueue = enqueue
        self.storage = Storage(settings.data_dir)
        self.catalog = Catalog(settings.models_dir, settings.hf_cache_dir)
        self.command = command
        self.forks = forks
        self.wake_on = wake_on
        self.me = settings.worker_name or worker_id()
        log.info("worker %s is process %d", self.me, os.getpid())
        self.devices = devices if devices is not None else detect_devices(settings.worker_devices)
        self.placer = Placer(self.catalog)
        self.stopping = stopping or threading.Event()
        self.recorder = Recorder(sessions, self.storage, settings.lease_seconds)
        self.outcome = Outcome(settings, sessions, self.storage, enqueue)
        self._node_lock = threading.Lock()  # held while this worker runs a node of another's job
        self._busy = threading.Event()  # set while this worker runs a job it claimed

    def run(self, hint: str | None = None) -> str:
        """Claim the next job this worker can run by the fair policy and run it. `hint` is the job id the
        wake-up carried: it does not decide which job runs (models.fairshare does). "skipped": none. A
        worker leased as a node of another worker's multi-node job runs that node instead."""
        if reserved_node(self.sessions, self.me) is not None:
            return self.run_node()
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
        self._busy.set()
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
            self._busy.clear()
            set_current_job(self.sessions, self.me, None)

    def _attempt(self, job_id: str, attempt: int, run_json: Path) -> str:
        # What _start needs, read once: supervise may ask it again while a fork server starts.
        node = my_node(self.sessions, self.me, job_id)  # node 0 of a multi-node job
        if node is not None and self.wake_on is not None:  # run.json is written: the others can start
            wake_peers(self.sessions, job_id, attempt, self.wake_on)
        single = node is None and training_processes(run_json) == 1
        forkable = self.command is None and self.forks is not None and single
        command = self.command or functools.partial(training_command, node=node)
        env = training_env(threads_per_run(self.settings.worker_concurrency))
        deadline = time.monotonic() + READY_TIMEOUT_S  # for a starting fork server
        try:
            rc = supervise(
                lambda: self._start(job_id, run_json, env, forkable, deadline, command),
                metrics_path=self.storage.metrics_path(job_id),
                interval=self.settings.progress_interval_seconds,
                started=lambda pid: self.recorder.started(job_id, attempt, pid),
                relay=lambda records: self._relay(job_id, attempt, records, node),
                stop_wanted=lambda: self.stopping.is_set() or self._stop_wanted(job_id),
            )
            if rc is None:
                log.warning("job %s: attempt %d lost its lease; another worker owns it now", job_id, attempt)
                return "lost"
            return self.outcome.judge(job_id, attempt, rc)
        finally:
            if node is not None:  # every node of the attempt is free again (the others stop on their own)
                release_nodes(self.sessions, job_id, attempt)

    def _relay(self, job_id: str, attempt: int, records: list[Any], node: Node | None) -> bool:
        """Relay the run's records (renewing the job's lease) and, as node 0, renew this node's lease."""
        owned = self.recorder.relay(job_id, attempt, records)
        if node is not None:
            keep_node(self.sessions, self.me, job_id, attempt, self.settings.lease_seconds)
        return owned

    def run_node(self) -> str:
        """Run the node this worker is leased as (rank > 0 of another worker's multi-node job) until it
        ends, renewing its lease; it is stopped when the attempt no longer runs, or on a pause, a cancel
        or this worker's shutdown. Node 0's worker judges the attempt. "skipped": no node, or running."""
        reserved = reserved_node(self.sessions, self.me)
        if reserved is None or not self._node_lock.acquire(blocking=False):
            return "skipped"
        job_id, attempt, node = reserved
        run_json = self.storage.run_config_path(job_id)  # node 0's, in the data directory all nodes mount
        command = self.command or functools.partial(training_command, node=node)
        env = training_env(threads_per_run(self.settings.worker_concurrency))
        interval = self.settings.progress_interval_seconds
        log.info("job %s: attempt %d, node %d of %d on %s", job_id, attempt, node.rank, node.count, self.me)
        set_current_job(self.sessions, self.me, job_id)
        try:
            rc = supervise(
                lambda: self._start_node(job_id, run_json, env, command, interval),
                metrics_path=self.storage.metrics_path(job_id),
                interval=interval,
                started=lambda pid: log.info("job %s: node %d is process %d", job_id, node.rank, pid),
                relay=lambda _: keep_node(
                    self.sessions, self.me, job_id, attempt, self.settings.lease_seconds
                ),
                stop_wanted=lambda: self.stopping.is_set() or self._stop_wanted(job_id),
            )
            log.info("job %s: node %d ended (exit %s)", job_id, node.rank, rc)
            return "node ended"
        finally:
            set_current_job(self.sessions, self.me, None)
            self._node_lock.release()

    def _start_node(
        self,
        job_id: str,
        run_json: Path,
        env: dict[str, str],
        command: Callable[[Path], list[str]],
        wait: float,
    ) -> Child | None:
        """The node's torchrun once node 0's worker has written run.json (None meanwhile, after `wait`)."""
        if not run_json.exists():
            time.sleep(wait)
            return None
        return spawn(command(run_json), self.storage.log_path(job_id), env)

    def start_reserved_node(self) -> bool:
        """From the worker's tick, for a node whose wake-up was lost (node 0's worker wakes the others on
        their own queues: worker.nodes.wake_peers): start the node this worker is leased as, in a thread
        of its own, unless one runs or a job this worker claimed runs (never both: the claim and the lease
        lock the worker's row, models.nodes). True if started."""
        if self._busy.is_set() or self._node_lock.locked() or reserved_node(self.sessions, self.me) is None:
            return False
        threading.Thread(target=self.run_node, name="ftune-node", daemon=True).start()
        return True

    def _start(
        self,
        job_id: str,
        run_json: Path,
        env: dict[str, str],
        forkable: bool,
        deadline: float,
        command: Callable[[Path], list[str]],
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
        return spawn(command(run_json), log_path, env)

    def _stop_wanted(self, job_id: str) -> bool:
        """A pause or a cancel was asked for."""
        with session_scope(self.sessions) as s:
            return jobs_db.stop_wanted(s, job_id=job_id)
