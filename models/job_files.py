"""A job's files in its tenant's storage quota (planner.job_files has what they are and how they are counted).

Admission projects them (`projection`) and reserves the projection on the Job row as its allowance
(files_allowance_bytes), under the tenant's lock (models.tenants.check_job_files_room). A job counts its
allowance while it is not finished, what its directory holds once it is (files_bytes, measured by
`measure_finished` before the next quota decision), and nothing once deleted (its files are gone).
"""

from __future__ import annotations

from sqlalchemy import case, func, select, update
from sqlalchemy.orm import Session

from core.arch import load_architecture
from core.catalog import Catalog
from core.errors import InvalidInput, NotFound
from core.spec import JobSpec
from core.states import TERMINAL
from core.storage import Storage
from models import datasets as datasets_db
from models.tables import Job
from planner import job_files

_FINISHED = [s.value for s in TERMINAL]


def projection(session: Session, *, catalog: Catalog, spec: JobSpec, tenant_id: str) -> job_files.Projection:
    """The most the job's files will take (planner.job_files.project), from its base model's architecture
    and its dataset's size."""
    try:
        model = catalog.get(spec.base_model)
    except NotFound as e:
        raise InvalidInput(e.message, code="model_not_found", param="base_model") from e
    ds = datasets_db.get_dataset(session, spec.dataset_id, tenant_id)
    examples = int((ds.report or {}).get("num_examples") or 0) if ds is not None else 0
    return job_files.project(spec, load_architecture(model.path), examples)


def jobs_bytes(session: Session, tenant_id: str) -> int:
    """What the tenant's jobs count in its storage quota: an unfinished job its allowance, a finished one
    its files (its allowance until they are measured), a deleted one nothing. Jobs admitted before
    allowances existed count what is measured of them once they finish."""
    finished = Job.status.in_(_FINISHED)
    counted = case(
        (finished, func.coalesce(Job.files_bytes, Job.files_allowance_bytes, 0)),
        else_=func.coalesce(Job.files_allowance_bytes, 0),
    )
    stmt = select(func.coalesce(func.sum(counted), 0)).where(
        Job.tenant_id == tenant_id, Job.deleted_at.is_(None)
    )
    return int(session.scalar(stmt) or 0)


def measure_finished(session: Session, storage: Storage, tenant_id: str) -> None:
    """Record what the tenant's finished jobs hold on disk where it is not recorded yet (a job that ended
    since the last decision: succeeded, failed, cancelled, or given up by the reaper). A finished job's
    files change no more, but by deletion (which stops their counting), so each is measured once."""
    stmt = select(Job.id).where(
        Job.tenant_id == tenant_id,
        Job.status.in_(_FINISHED),
        Job.deleted_at.is_(None),
        Job.files_bytes.is_(None),
    )
    for job_id in session.scalars(stmt).all():
        size = job_files.stored_bytes(storage.job_dir(job_id))
        session.execute(
            update(Job).where(Job.id == job_id, Job.files_bytes.is_(None)).values(files_bytes=size)
        )
