"""Claiming the next job this worker can run, by the fair policy (models.fairshare), and placing it.

The claim is a compare-and-set, so a redelivered message claims nothing twice; which job is claimed is
decided here, never by the message that woke the worker. The plan re-made on this worker's devices
(models.placement) is the one the job runs under.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from core.storage import Storage, atomic_write_text
from models import fairshare
from models import jobs as jobs_db
from models import nodes as nodes_db
from models import workers as workers_db
from models.db import session_scope
from models.placement import Placer
from models.tables import Job
from models.tables import Worker as WorkerRow

log = logging.getLogger(__name__)


CLAIM_TRIES = 3  # a claim rolled back because another took one of its workers meanwhile is tried again


def claim_next(
    sessions: sessionmaker[Session],
    *,
    settings: Settings,
    storage: Storage,
    placer: Placer,
    devices: list[dict[str, Any]],
    worker: str,
) -> tuple[str, int] | None:
    """(job id, attempt) of the job claimed and placed on this worker, or None when none can run here. A
    multi-node job is claimed only with all its other nodes leased in the same transaction (models.nodes):
    if one was taken meanwhile, the whole claim rolls back and the job stays queued; the claim is then
    tried again (the fair pick may now be another job), unless this worker itself was leased as a node."""
    for _ in range(CLAIM_TRIES):
        try:
            with session_scope(sessions) as s:
                return _claim(
                    s, settings=settings, storage=storage, placer=placer, devices=devices, worker=worker
                )
        except nodes_db.GangUnavailable as e:
            log.info("claim by %s rolled back: %s", worker, e)
            if worker in e.taken:
                return None  # leased as a node of another worker's job meanwhile: that node runs instead
    return None


def _claim(
    s: Session,
    *,
    settings: Settings,
    storage: Storage,
    placer: Placer,
    devices: list[dict[str, Any]],
    worker: str,
) -> tuple[str, int] | None:
    """One try in one transaction: the fair pick (a compare-and-set), then its workers locked and read
    again (models.nodes.lock, taken), then the other nodes leased. GangUnavailable rolls it all back."""
    claimed = fairshare.claim_next(
        s,
        can_run=lambda job: placer.fits(job, devices) and _peers(s, placer, job, worker) is not None,
        worker_id=worker,
        lease_seconds=settings.lease_seconds,
        running_limit=settings.max_running_jobs_per_tenant,
    )
    if claimed is None:
        return None
    job, attempt = claimed
    peers = _peers(s, placer, job, worker)
    if peers is None:
        raise nodes_db.GangUnavailable(f"job {job.id}: its other nodes were taken meanwhile")
    nodes_db.lock(s, [worker, *peers])
    if taken := nodes_db.taken(s, claimant=worker, peers=peers):
        raise nodes_db.GangUnavailable(f"job {job.id}: {', '.join(sorted(taken))} taken meanwhile", taken)
    if peers:
        endpoint = f"{_hostname(s, worker)}:{free_port()}"
        nodes_db.reserve(
            s,
            job_id=job.id,
            attempt=attempt,
            workers=[worker, *peers],
            endpoint=endpoint,
            lease_seconds=settings.lease_seconds,
        )
    _record_placement(
        s, storage=storage, placer=placer, devices=devices, worker=worker, job=job, attempt=attempt
    )
    return job.id, attempt


def _peers(s: Session, placer: Placer, job: Job, worker: str) -> list[str] | None:
    """The other nodes' workers for a multi-node job ([] for one node), or None when not enough are
    free now (the job is not claimed: nothing is held while waiting)."""
    want = nodes_db.num_nodes(job) - 1
    if want == 0:
        return []
    free = nodes_db.idle_peers(s, fits=lambda w: placer.fits(job, w.devices), claimant=worker)
    return [w.id for w in free[:want]] if len(free) >= want else None


def _hostname(s: Session, worker: str) -> str:
    """Where the other nodes reach this worker: the host it registered with."""
    row = s.get(WorkerRow, worker)
    return row.hostname if row is not None else socket.gethostname()


def free_port() -> int:
    """A port free on this machine now, for the rendezvous store of the attempt claimed here."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _record_placement(
    s: Session,
    *,
    storage: Storage,
    placer: Placer,
    devices: list[dict[str, Any]],
    worker: str,
    job: Job,
    attempt: int,
) -> None:
    """The plan re-made on this worker's devices is the one the job runs under: plan.json and the
    prediction shown beside the measured peak are replaced, the event keeps both."""
    verdict = placer.verdict(job, devices)
    data: dict[str, Any] = {"worker": worker, "devices": devices, "attempt": attempt}
    data["admission_predicted_bytes"] = job.predicted_peak_bytes
    plan = verdict.plan
    if plan is not None:
        atomic_write_text(storage.plan_path(job.id), plan.model_dump_json())
        jobs_db.set_predicted_peak(s, job_id=job.id, predicted_peak_bytes=plan.allocated_bytes)
        data |= {
            "device": plan.gpu,
            "predicted_bytes": plan.allocated_bytes,
            "plan_total": plan.total_bytes,
        }
    where = f" on {plan.gpu}: plan {plan.total_bytes / 2**30:.2f} GiB" if plan else " (no plan)"
    msg = f"placed on {worker}{where}"
    jobs_db.add_event(s, job_id=job.id, kind="placed", message=msg, data=data)


def set_current_job(sessions: sessionmaker[Session], worker: str, job_id: str | None) -> None:
    """What the fleet table shows this worker running (None: idle)."""
    with session_scope(sessions) as s:
        workers_db.set_current_job(s, worker, job_id)
