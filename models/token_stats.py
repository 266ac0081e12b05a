"""A job's token statistics: who measures them, when, in which process, and what is done with them.

The one owner of the idea. Its parts:
  core.data.token_stats   the records (TokenStats, what is stored; StatsRequest, Compute), pure
  training.token_stats    the counting, tokenized exactly as training does: `python -m training.token_stats`
  this module             launching that computation as a child process with a timeout, and storing its answer
  models.replan           the job's plan re-made from the stored statistics

Who runs what:
- Submission (models.submission.submit_job, in the API process, or in `ftune jobs submit`): a job whose
  worst case does not fit is measured at once by `measure_at_admission`, bounded by
  settings.admission_measure_seconds, the child's memory and CPU limits and the process's measurement
  gate (one per tenant, a few in all: 429 past them), and admitted on its data's lengths; the answer is
  stored with the job. Any other job is stored "pending" and an `ftune.token_stats` message is published.
- The CPU worker (`ftune worker --queue cpu`, task `ftune.token_stats` in worker.tasks) runs
  `compute_and_store`: measured with settings.token_stats_timeout_seconds, stored unless training's start
  filled them first, and the job re-planned from them.
- The training worker (worker.recording) fills them from training's "start" record when they are not
  ready by then (none ran, a lost message, a timeout or a failure).

The computation always runs in a child process (`subprocess_compute`): tokenizing is batch work, and the
processes that launch it (the API, the workers) never import torch. The launcher imports
training.token_stats for its module name only, when it launches: that module imports no torch at import
time, and importing the API loads nothing of training (tests/test_layout.py). pyproject.toml's
import-linter contracts name this one edge into training. Paths are resolved from ids here, never taken
from users.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from core.catalog import Catalog
from core.data.token_stats import PENDING, Compute, StatsRequest, TokenStats, failed
from core.errors import FtuneError, without_paths
from core.process import child_env
from core.settings import Settings
from core.spec import JobSpec
from core.storage import Storage
from models import datasets as datasets_db
from models import jobs as jobs_db
from models.admission import Measure
from models.db import session_scope
from models.fleet_limits import FleetCounters
from models.replan import replan
from models.tenants import TenantGate

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25  # how soon a shutdown or the timeout kills a running computation
# What a child past its memory limit says: Python's MemoryError, or a library it cannot map.
OUT_OF_MEMORY = ("MemoryError", "failed to map segment", "Cannot allocate memory")


# The child's limits, set by the child itself before it becomes the computation (exec keeps them): no
# preexec_fn, which is not fork-safe in a threaded parent. argv: memory bytes, CPU seconds (0: none), the
# computation's arguments.
LIMITS_PRELUDE = (
    "import os, resource, sys\n"
    "mem, cpu = int(sys.argv[1]), int(sys.argv[2])\n"
    "if mem: resource.setrlimit(resource.RLIMIT_AS, (mem, mem))\n"
    "if cpu: resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[3:]])\n"
)


def limited_command(args: list[str], *, memory_bytes: int = 0, cpu_seconds: int = 0) -> list[str]:
    """`python <args>` with its address space (RLIMIT_AS) and CPU time (RLIMIT_CPU) bounded (0: unbounded).
    Past the memory limit an allocation fails (MemoryError); past the CPU time the kernel kills it."""
    if not memory_bytes and not cpu_seconds:
        return [sys.executable, *args]
    return [sys.executable, "-c", LIMITS_PRELUDE, str(memory_bytes), str(cpu_seconds), *args]


def subprocess_compute(timeout_seconds: float, *, memory_bytes: int = 0, cpu_seconds: int = 0) -> Compute:
    """The real computation: `python -m training.token_stats` in a child process, with a timeout, and
    limits on its memory and CPU time when given (limited_command)."""

    def compute(request: StatsRequest, stop: threading.Event) -> dict[str, Any] | None:
        # The one edge into training (named in pyproject's import contracts): for its module name. Imported
        # here, not at the top, so that importing the API or a worker loads nothing of training.
        from training import token_stats

        args = [
            "-m", token_stats.__name__,
            "--model-dir", str(request.model_dir),
            "--dataset", str(request.dataset_path),
            "--spec", request.spec_json,
            "--column-mapping", json.dumps(request.column_mapping),
        ]  # fmt: skip
        cmd = limited_command(args, memory_bytes=memory_bytes, cpu_seconds=cpu_seconds)
        # No preexec_fn (not fork-safe in a threaded worker): the child ties itself to this process. One
        # thread and few malloc arenas: tokenizing needs no more, and the address space stays small.
        env = child_env(
            HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2"
        )
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
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


def worker_compute(settings: Settings) -> Compute:
    """The CPU worker's computation (the `ftune.token_stats` task): a tenant's data as at admission, so
    under the same address-space limit (settings.admission_measure_max_memory_bytes), and its CPU time
    bounded by its own timeout (settings.token_stats_timeout_seconds)."""
    timeout = settings.token_stats_timeout_seconds
    return subprocess_compute(
        timeout, memory_bytes=settings.admission_measure_max_memory_bytes, cpu_seconds=math.ceil(timeout)
    )


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
        # Shown to the tenant: without the server's paths (the log above has them).
        return failed(str(err.get("code", "token_stats_error")), without_paths(str(err.get("message", ""))))
    if returncode == 0 and isinstance(answer, dict):
        try:
            value = TokenStats.model_validate({**answer, "status": "ready", "source": "job_created"})
            return value.model_dump(mode="json", exclude_none=True)
        except ValidationError:
            log.exception("job %s: token statistics answer of an unexpected shape: %s", job_id, answer)
    else:
        log.warning("job %s: token statistics exited with %d\n%s", job_id, returncode, stderr[-4000:])
    if any(sign in stderr[-4000:] for sign in OUT_OF_MEMORY):  # past its RLIMIT_AS (limited_command)
        return failed("token_stats_memory", "token statistics ran out of the memory they may use")
    if returncode == -signal.SIGXCPU:
        return failed("token_stats_cpu", "token statistics used up the CPU time they may use")
    return failed("token_stats_error", f"token statistics exited with code {returncode}; see the worker log")


def stats_request(
    session: Session, *, catalog: Catalog, storage: Storage, spec: JobSpec, job_id: str
) -> StatsRequest:
    """What measuring a job's token statistics needs, resolved from its spec's ids (never a user's paths)."""
    dataset = datasets_db.get_dataset(session, spec.dataset_id)
    return StatsRequest(
        job_id=job_id,
        model_dir=catalog.get(spec.base_model).path,
        dataset_path=storage.dataset_path(spec.dataset_id),
        column_mapping=dataset.report.get("column_mapping") if dataset is not None else None,
        spec_json=spec.model_dump_json(),
    )


MEASURE_RETRY_AFTER = 10  # seconds: a measurement of a small data set takes a few


def measurement_gate(settings: Settings, fleet: FleetCounters | None = None) -> TenantGate:
    """The bound on measurements at admission: one per tenant (across the fleet with `fleet`), and
    settings.admission_max_concurrent_measurements of all tenants together in this process, at once (429
    past either)."""
    return TenantGate(
        what="measurements of data at admission",
        code="too_many_measurements",
        per_tenant=1,
        total=settings.admission_max_concurrent_measurements,
        retry_after=MEASURE_RETRY_AFTER,
        fleet=fleet,
    )


def measure_at_admission(
    session: Session,
    *,
    catalog: Catalog,
    storage: Storage,
    job_id: str,
    settings: Settings,
    tenant_id: str,
    gate: TenantGate | None = None,
) -> Measure | None:
    """Admission's measurement of a job's token statistics (its worst case did not fit), bounded by
    settings.admission_measure_seconds (0: never; the worst case decides), its child's memory and CPU time
    (settings.admission_measure_max_memory_bytes, _max_cpu_seconds; 0 CPU seconds: the timeout's), and
    `gate` (a measurement past it raises RateLimited before anything is started)."""
    if settings.admission_measure_seconds <= 0:
        return None
    cpu_seconds = settings.admission_measure_max_cpu_seconds or math.ceil(settings.admission_measure_seconds)
    compute = subprocess_compute(
        settings.admission_measure_seconds,
        memory_bytes=settings.admission_measure_max_memory_bytes,
        cpu_seconds=cpu_seconds,
    )
    gate = gate or measurement_gate(settings)

    def measure(spec: JobSpec) -> dict[str, Any]:
        request = stats_request(session, catalog=catalog, storage=storage, spec=spec, job_id=job_id)
        with gate.hold(tenant_id):
            return compute(request, threading.Event()) or failed("stopped", "the measurement was stopped")

    return measure


def request_for(session: Session, *, catalog: Catalog, storage: Storage, job_id: str) -> StatsRequest | None:
    """The request for a job, or None when there is nothing to do: the job is gone, or its statistics
    are no longer pending (a redelivered message, or training's start filled them)."""
    job = jobs_db.get_job(session, job_id)
    if job is None or (job.token_stats or {}).get("status") != PENDING["status"]:
        return None
    spec = JobSpec.model_validate(job.spec)
    return stats_request(session, catalog=catalog, storage=storage, spec=spec, job_id=job_id)


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
    """The `ftune.token_stats` task's work: compute and store one job's statistics, then re-plan the job
    from them (models.replan); returns what happened (for the task's log; "replanned": the job may now
    fit other workers). The message carries the job id only: everything else is read from the database."""
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
