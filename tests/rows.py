"""Rows that tests put straight into the database when the upload path is not what they test."""

from __future__ import annotations

import time

from sqlalchemy.orm import Session

from core.states import JobStatus
from models.tables import Dataset, Job
from models.transitions import transition


def valid_dataset(tenant_id: str, dataset_id: str) -> Dataset:
    """A valid one-example instruction dataset row (no file on disk)."""
    return Dataset(
        id=dataset_id,
        tenant_id=tenant_id,
        filename="x.jsonl",
        status="valid",
        format="instruction",
        num_examples=1,
        size_bytes=1,
        sha256="0" * 64,
        report={},
    )


def succeeded_job(session: Session, tenant_id: str) -> str:
    """A job of the tenant that has just succeeded (its webhook events are in the outbox): its id."""
    n = time.time_ns()
    dataset_id, job_id = f"{n:031x}d", f"{n:031x}j"
    session.add(valid_dataset(tenant_id, dataset_id))
    session.add(
        Job(
            id=job_id,
            tenant_id=tenant_id,
            status="running",
            spec={},
            dataset_id=dataset_id,
            base_model="tiny",
            method="lora",
        )
    )
    session.flush()
    assert transition(session, job_id=job_id, src=JobStatus.RUNNING, dst=JobStatus.SUCCEEDED)
    return job_id
