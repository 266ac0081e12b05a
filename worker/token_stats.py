"""A job's token statistics: the work of the `ftune.token_stats` task, served on the CPU queue.

`python -m training.token_stats` runs as a subprocess (core.data.measure) with a timeout; the answer is
stored on the job unless training's start filled it first (models.jobs.store_token_stats), and the job is
re-planned from it (models.replan). The message carries the job id only: model, dataset, mapping and
spec are read from the database and resolved to paths here, never taken from users.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy.orm import Session, sessionmaker

from core.catalog import Catalog
from core.data.measure import Compute, StatsRequest
from core.data.token_stats import PENDING, failed
from core.errors import FtuneError
from core.spec import JobSpec
from core.storage import Storage
from models import jobs as jobs_db
from models.admission import stats_request
from models.db import session_scope
from models.replan import replan

log = logging.getLogger(__name__)


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
