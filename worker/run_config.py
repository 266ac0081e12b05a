"""What the training subprocess is told: run.json (core.run_protocol.RunConfig), written from the job's row.

Paths are resolved here from ids (the catalog's model, the stored datasets, an earlier job's adapter),
never taken from users.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from core.catalog import Catalog
from core.run_protocol import GradingConfig, RunConfig
from core.spec import JobSpec
from core.storage import Storage, atomic_write_text
from models import datasets as datasets_db
from models import jobs as jobs_db
from models import openai_jobs
from models.db import session_scope


def write_run_config(
    sessions: sessionmaker[Session],
    *,
    storage: Storage,
    catalog: Catalog,
    job_id: str,
    grading: GradingConfig | None = None,
    compile_layers: bool = True,
) -> Path:
    """Write the job's run.json (and clear an earlier attempt's error file); returns its path. `grading`:
    how a grpo run grades, `compile_layers` whether its engine compiles (the worker's settings; run.json
    is the worker's own, mode 0600)."""
    with session_scope(sessions) as s:
        job = jobs_db.get_job(s, job_id)
        assert job is not None
        spec = JobSpec.model_validate(job.spec)
        mapping = _column_mapping(s, spec.dataset_id)
        val_mapping = _column_mapping(s, spec.validation_dataset_id)
        init_dir = _init_adapter_dir(s, storage, spec)
        tenant_id = job.tenant_id
        allowance = job.files_allowance_bytes
    model = catalog.get(spec.base_model)
    config = RunConfig(
        job_id=job_id,
        spec=spec,
        model_dir=str(model.path),
        dataset_path=str(storage.dataset_path(spec.dataset_id)),
        output_dir=str(storage.job_dir(job_id)),
        column_mapping=mapping,
        validation_path=(
            str(storage.dataset_path(spec.validation_dataset_id)) if spec.validation_dataset_id else None
        ),
        validation_column_mapping=val_mapping,
        # spec.init_from: the earlier job's adapter (admission checked its tenant, status and base)
        init_adapter_dir=str(init_dir) if init_dir else None,
        # the judge of model graders acts for the job's tenant (graders.judge)
        grading=(grading or GradingConfig()).model_copy(update={"tenant_id": tenant_id}),
        compile_layers=compile_layers,
        files_allowance_bytes=allowance,  # the job's files in its tenant's storage quota
    )
    path = storage.run_config_path(job_id)
    atomic_write_text(path, config.model_dump_json(indent=2))
    storage.error_path(job_id).unlink(missing_ok=True)  # from an earlier attempt
    return path


def _init_adapter_dir(s: Session, storage: Storage, spec: JobSpec) -> Path | None:
    """spec.init_from's final adapter, or (init_from_step) its checkpoint at that step, as recorded when
    it was saved; admission checked the job's tenant, status and base, and that the checkpoint exists."""
    if spec.init_from is None:
        return None
    if spec.init_from_step is None:
        return storage.adapter_dir(spec.init_from)
    saved = openai_jobs.checkpoint(s, spec.init_from, spec.init_from_step)
    if saved is None:
        raise FileNotFoundError(f"job {spec.init_from} has no checkpoint at step {spec.init_from_step}")
    return storage.job_dir(spec.init_from) / saved.relpath


def _column_mapping(s: Session, dataset_id: str | None) -> dict[str, str] | None:
    """The column mapping a dataset was uploaded with (its rows are read through it)."""
    dataset = datasets_db.get_dataset(s, dataset_id) if dataset_id else None
    return dataset.report.get("column_mapping") if dataset else None
