"""A job's token statistics: the work of the `ftune.token_stats` task, served on the CPU queue.

`python -m training.token_stats` runs as a subprocess (the worker never imports training or torch) with
a timeout; the answer is stored on the job unless training's start filled it first
(models.jobs.store_token_stats). The message carries the job id only: model, dataset, mapping and spec
are read from the database and resolved to paths here, never taken from users.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from core.catalog import Catalog
from core.data.token_stats import PENDING, TokenStats, failed
from core.errors import FtuneError
from core.process import child_env
from core.spec import JobSpec
from core.storage import Storage
from models import datasets as datasets_db
from models import jobs as jobs_db
from models.db import session_scope
from models.replan import replan

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25  # how soon a shutdown or the timeout kills a running computation


@dataclass(frozen=True)
class StatsRequest:
    """Everything the computation needs, resolved from the job's row."""

    job_id: str
    model_dir: Path
    dataset_path: Path
    column_mapping: dict[str, str] | None
    spec_json: str


# Returns the value to store ({"status": "ready", ...} or core.data.token_stats.failed(...)), or None when
# stopped by a shutdown (nothing is stored: the job stays "pending" for training's start to fill).
Compute = Callable[[StatsRequest, threading.Event], dict[str, Any] | None]


def request_for(session: Session, *, catalog: Catalog, storage: Storage, job_id: str) -> StatsRequest | None:
    """The request for a job, or None when there is nothing to do: the job is gone, or its statistics
    are no longer pending (a redelivered message, or training's start filled them)."""
    job = jobs_db.get_job(session, job_id)
    if job is None or (job.token_stats or {}).get("status") != PENDING["status"]:
        return None
    spec = JobSpec.model_validate(job.spec)
    dataset = datasets_db.get_dataset(session, spec.dataset_id)
    return StatsRequest(
        job_id=job_id,
        model_dir=catalog.get(spec.base_model).path,
        dataset_path=storage.dataset_path(spec.dataset_id),
        column_mapping=dataset.report.get("column_mapping") if dataset is not None else None,
        spec_json=spec.model_dump_json(),
    )


def compute_and_store(
    sessions: sessionmaker[Session],
    *,
    catalog: Catalog,
    storage: Storage,
    compute: Compute,
    job_id: str,
    stop: threading.Event,
    plan_gpu: str = "",
) -> str:
    """Compute and store one job's statistics, then re-plan the job from them (models.replan); returns
    what happened (for the task's log; "replanned": the job may now fit other workers)."""
    try:
        with sessions() as s:
            request = request_for(s, catalog=catalog, storage=storage, job_id=job_id)
        if request is None:
            return "skipped"
        result = compute(request, stop)
    except FtuneError as e:  # e.g. the base model was removed after admission
        result = failed(e.code, e.message)
    except Exception:
        log.exception("job %s: token statistics failed", job_id)
        result = failed("token_stats_error", "token statistics failed; see the worker log")
    if result is None:
        return "stopped"
    with session_scope(sessions) as s:
        if not jobs_db.store_token_stats(s, job_id, result):
            log.info("job %s: token statistics already filled by training; kept those", job_id)
            return "kept"
    if result["status"] != "ready":
        return str(result["status"])
    with session_scope(sessions) as s:  # the plan from the data's lengths, in a transaction of its own
        plan = replan(s, catalog=catalog, storage=storage, job_id=job_id, plan_gpu=plan_gpu)
    return "replanned" if plan is not None else "ready"


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
        # No preexec_fn (not fork-safe in a threaded worker): the child ties itself to this process.
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=child_env(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"),
        )
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
    return failed("token_stats_error", f"token statistics exited with code {returncode}; see the worker log")
