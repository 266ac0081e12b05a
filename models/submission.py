"""Submitting a job: the one path from a JobSpec to a queued job, called by the native route, the CLI
(`ftune jobs submit`) and the OpenAI-shaped surface.

The tenant's job slot (quota), admission (dataset, model, plan; perhaps a measurement), the job's files
in the tenant's storage quota (models.job_files: 413 storage_quota_exceeded), then the Job row and its plan
file; after the commit, the job's token statistics are asked for (unless admission
measured them: models.token_stats) and a worker is woken. Both publishers are injected
(core.queues.Enqueuer on the broker, or a test's double), so this module knows no broker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from core.catalog import Catalog
from core.settings import Settings
from core.spec import JobSpec
from core.storage import Storage, atomic_write_text, new_id
from models import job_files as job_files_db
from models import jobs as jobs_db
from models import tenants as tenants_db
from models.admission import Admitted, ToolsCheck, admit, check_grader_policy, recheck_references
from models.db import session_scope
from models.tables import Job
from models.tenants import TenantGate
from models.token_stats import measure_at_admission
from models.tool_support import from_settings as tools_check_for
from planner.job_files import Projection

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenAIFields:
    suffix: str | None
    metadata: dict[str, str] | None
    request: dict[str, Any]  # hyperparameters and method as resolved, file ids


Publish = Callable[[str], bool]  # a job id -> sent to the broker (False: unreachable, the DB has it)


def submit_job(
    sessions: sessionmaker[Session],
    *,
    settings: Settings,
    catalog: Catalog,
    storage: Storage,
    spec: JobSpec,
    tenant_id: str,
    enqueue: Publish,
    request_token_stats: Publish,
    openai: OpenAIFields | None = None,
    measurements: TenantGate | None = None,
    tools_check: ToolsCheck | None = None,
) -> Job:
    """Admit and store the job, then publish; returns the job as accepted (queued). Raises core.errors
    (RateLimited, InvalidInput, Unsupported, Conflict, ...) for a job that is refused; then nothing is stored.
    `openai`: what a /v1 job carries beyond its spec (suffix, metadata, resolved hyperparameters).
    `measurements`: the process's bound on measurements at admission (models.token_stats.measurement_gate).
    `tools_check`: whether a base model's template renders tools (default: models.tool_support's probe).

    Three transactions, none held while the data is measured: the tenant's job slot is reserved (so
    concurrent creates cannot all pass the quota), the job is admitted (reads, and perhaps a measurement),
    then the slot becomes the Job row, its references checked again under the tenant's lock."""
    check_grader_policy(spec, settings)
    job_id = new_id()
    limit = settings.max_active_jobs_per_tenant
    ttl = slot_ttl_seconds(settings)
    with session_scope(sessions) as s:
        tenants_db.reserve_job_slot(s, tenant_id, job_id, limit=limit, ttl_seconds=ttl)
    try:
        with sessions() as s:
            admitted, files = _admit(
                s,
                settings=settings,
                catalog=catalog,
                storage=storage,
                spec=spec,
                tenant_id=tenant_id,
                job_id=job_id,
                measurements=measurements,
                tools_check=tools_check,
            )
        plan = admitted.plan
        with session_scope(sessions) as s:  # before the tenant's lock: what its finished jobs hold
            job_files_db.measure_finished(s, storage, tenant_id)
        with session_scope(sessions) as s:
            tenants_db.take_job_slot(s, tenant_id, job_id, limit=limit, ttl_seconds=ttl)
            recheck_references(s, spec=spec, tenant_id=tenant_id)
            tenants_db.check_job_files_room(s, tenant_id, files, settings.max_stored_bytes_per_tenant)
            predicted = plan.allocated_bytes if plan else None
            created = jobs_db.create_job(s, tenant_id, job_id, spec, predicted, settings.max_attempts)
            created.files_allowance_bytes = files.total  # reserved in the quota (models.job_files)
            if admitted.token_stats is not None:  # measured to admit it: nothing left to ask a worker for
                jobs_db.store_token_stats(s, job_id, admitted.token_stats)
            if openai is not None:
                created.suffix, created.user_metadata = openai.suffix, openai.metadata
                created.openai = openai.request
            if plan is not None:  # the itemised prediction, shown beside the measured peak on the job page
                atomic_write_text(storage.admission_plan_path(job_id), plan.model_dump_json())
                atomic_write_text(storage.plan_path(job_id), plan.model_dump_json())  # until re-planned
            jobs_db.mark_enqueued(s, job_id=job_id)
    except BaseException:
        _give_back(sessions, tenant_id, job_id)
        raise
    with sessions() as s:  # read before the wake-up: the answer is the job as accepted, queued
        job = jobs_db.get_job(s, job_id)
        assert job is not None
    # After the commit, so a worker always finds the row. A lost message is covered: token statistics
    # are filled from training's start record, and the reaper re-sends a queued job's wake-up.
    if admitted.token_stats is None:
        request_token_stats(job_id)
    enqueue(job_id)
    return job


def _admit(
    s: Session,
    *,
    settings: Settings,
    catalog: Catalog,
    storage: Storage,
    spec: JobSpec,
    tenant_id: str,
    job_id: str,
    measurements: TenantGate | None,
    tools_check: ToolsCheck | None,
) -> tuple[Admitted, Projection]:
    """Admission (measuring the data first where its worst case does not fit) and the job's files."""
    measure = measure_at_admission(
        s,
        catalog=catalog,
        storage=storage,
        job_id=job_id,
        settings=settings,
        tenant_id=tenant_id,
        gate=measurements,
    )
    admitted = admit(
        s,
        catalog=catalog,
        spec=spec,
        tenant_id=tenant_id,
        plan_gpu=settings.plan_gpu,
        measure=measure,
        tools_check=tools_check or tools_check_for(settings),
    )
    return admitted, job_files_db.projection(s, catalog=catalog, spec=spec, tenant_id=tenant_id)


def slot_ttl_seconds(settings: Settings) -> float:
    """How long a reserved job slot counts: well past the longest admission (its measurement's bound)."""
    return 2 * settings.admission_measure_seconds + 120


def _give_back(sessions: sessionmaker[Session], tenant_id: str, job_id: str) -> None:
    """The refused (or failed) job's slot, freed; a failure here only leaves it to expire."""
    try:
        with session_scope(sessions) as s:
            tenants_db.release_job_slot(s, tenant_id, job_id)
    except Exception:
        log.exception("job %s: its admission slot could not be given back; it expires by itself", job_id)
