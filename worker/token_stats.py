"""A new job's token statistics, computed in the background of the API process.

One thread per process runs `python -m training.token_stats` (a subprocess: the API never imports
torch) with a timeout, then stores the result on the job unless training's start filled it first
(models.jobs.store_token_stats). If this process dies first the job stays "pending" until the worker
fills it from training's start record (worker.runner).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from core.catalog import Catalog
from core.data.token_stats import TokenStats, failed
from core.spec import JobSpec
from core.storage import Storage
from models import datasets as datasets_db
from models import jobs as jobs_db
from models.db import session_scope

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25  # how soon a shutdown or the timeout kills a running computation


@dataclass(frozen=True)
class StatsRequest:
    """Everything the computation needs; the paths are resolved from ids, never taken from users."""

    job_id: str
    model_dir: Path
    dataset_path: Path
    column_mapping: dict[str, str] | None
    spec_json: str


# Returns the value to store ({"status": "ready", ...} or core.data.token_stats.failed(...)), or None when
# stopped by a shutdown (nothing is stored: the job stays "pending" for the worker to fill).
Compute = Callable[[StatsRequest, threading.Event], dict[str, Any] | None]


def request_for(
    session: Session, catalog: Catalog, storage: Storage, job_id: str, spec: JobSpec, tenant_id: str
) -> StatsRequest:
    """The request for an admitted job (its model and dataset were checked by admission)."""
    dataset = datasets_db.get_dataset(session, spec.dataset_id, tenant_id)
    return StatsRequest(
        job_id=job_id,
        model_dir=catalog.get(spec.base_model).path,
        dataset_path=storage.dataset_path(spec.dataset_id),
        column_mapping=dataset.report.get("column_mapping") if dataset is not None else None,
        spec_json=spec.model_dump_json(),
    )


class TokenStatsQueue:
    """A bounded background queue: one worker thread, at most `max_waiting` computations queued."""

    def __init__(self, sessions: sessionmaker[Session], compute: Compute, max_waiting: int) -> None:
        self.sessions = sessions
        self.compute = compute
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self._waiting = 0
        self._executor: ThreadPoolExecutor | None = None
        self._stop = threading.Event()

    def submit(self, request: StatsRequest) -> Future[None] | None:
        """Queue the computation; when the queue is full, record that it was skipped."""
        with self._lock:
            if self._waiting < self.max_waiting:
                self._waiting += 1
                if self._executor is None:  # started on first use, and again after a close()
                    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="token-stats")
                    self._stop = threading.Event()
                return self._executor.submit(self._run, request, self._stop)
        waiting = f"{self.max_waiting} computations were waiting already"
        self._store(request.job_id, failed("busy", f"{waiting}; they are filled when training starts"))
        return None

    def close(self) -> None:
        """Kill a running computation and drop the waiting ones (their jobs stay "pending")."""
        with self._lock:
            executor, self._executor = self._executor, None
            self._stop.set()
            self._waiting = 0
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def _run(self, request: StatsRequest, stop: threading.Event) -> None:
        try:
            result = self.compute(request, stop)
        except Exception:
            log.exception("job %s: token statistics failed", request.job_id)
            result = failed("token_stats_error", "token statistics failed; see the server log")
        finally:
            with self._lock:
                self._waiting = max(0, self._waiting - 1)
        if result is not None:
            self._store(request.job_id, result)

    def _store(self, job_id: str, result: dict[str, Any]) -> None:
        try:
            with session_scope(self.sessions) as s:
                if not jobs_db.store_token_stats(s, job_id, result):
                    log.info("job %s: token statistics already filled by training; kept those", job_id)
        except Exception:  # e.g. the database is away: the worker fills them at training start
            log.exception("job %s: token statistics could not be stored", job_id)


def subprocess_compute(timeout_seconds: float) -> Compute:
    """The real computation: `python -m training.token_stats` with a timeout."""

    def compute(request: StatsRequest, stop: threading.Event) -> dict[str, Any] | None:
        cmd = [
            sys.executable, "-m", "training.token_stats",
            "--model-dir", str(request.model_dir),
            "--dataset", str(request.dataset_path),
            "--spec", request.spec_json,
            "--column-mapping", json.dumps(request.column_mapping),
        ]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        # No preexec_fn (unsafe in a threaded server): the child lowers its own priority and ties
        # itself to this process (training.token_stats.detach_from_requests).
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + timeout_seconds
        while True:
            try:
                out, err = proc.communicate(timeout=POLL_SECONDS)  # retrying loses no output
                break
            except subprocess.TimeoutExpired:
                if stop.is_set() or time.monotonic() > deadline:
                    proc.kill()
                    proc.communicate()
                    if stop.is_set():
                        return None
                    return failed(
                        "timeout",
                        f"token statistics took longer than {timeout_seconds:g} s; "
                        "they are filled when training starts",
                    )
        return parse_output(request.job_id, proc.returncode, out, err)

    return compute


def parse_output(job_id: str, returncode: int, stdout: str, stderr: str) -> dict[str, Any]:
    """The stored value for the process's answer: its last stdout line is one JSON object."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        err = answer["error"]
        log.warning("job %s: token statistics failed: %s\n%s", job_id, err, stderr[-4000:])
        return failed(str(err.get("code", "token_stats_error")), str(err.get("message", "")))
    if returncode == 0 and isinstance(answer, dict):
        try:
            value = TokenStats.model_validate({**answer, "status": "ready", "source": "job_created"})
            return value.model_dump(mode="json", exclude_none=True)
        except ValidationError:
            log.exception("job %s: token statistics answer of an unexpected shape: %s", job_id, answer)
    else:
        log.warning("job %s: token statistics exited with %d\n%s", job_id, returncode, stderr[-4000:])
    return failed("token_stats_error", f"token statistics exited with code {returncode}; see the server log")
