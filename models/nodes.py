"""Gang placement of multi-node jobs (spec num_nodes): all of a job's nodes leased in one transaction,
or none.

The worker that claims the job is its node 0; in the same transaction it leases num_nodes - 1 idle
workers as the other nodes (a NodeLease row each, keyed by worker). Nothing is held while waiting: a
job whose peers are not all free now is not claimed at all (it stays queued, its claimant claims
another), so two half-placed jobs can never wait on each other. A worker reserved by two jobs at once
is impossible (the primary key), and the loser's whole claim is rolled back.

Claims race: on PostgreSQL a transaction does not see another's uncommitted claim, so a worker could be
leased as a node while it claims a job of its own, or leased by two claims that each saw it free. So a
claim, once it holds its job, locks the rows of its workers (`lock`, in id order: two claims never wait
on each other in a cycle) and reads again (`taken`) whether they are still free; the second of two
claims on one worker waits for the first to commit and then sees it. SQLite has one writer at a time:
everything a claim reads after its first write is already current.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, delete, exists, select, union, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.states import OWNED
from models import workers as workers_db
from models.db import rows_changed
from models.tables import Job, NodeLease, Worker, utcnow


class GangUnavailable(Exception):
    """Not every node could be leased: the claim that needed them must be rolled back. `taken`: the
    workers found taken, where known."""

    def __init__(self, message: str, taken: set[str] | None = None) -> None:
        super().__init__(message)
        self.taken = taken or set()


def num_nodes(job: Job) -> int:
    """The job's spec num_nodes, read raw: this runs per queued job per claim."""
    return int((job.spec or {}).get("num_nodes") or 1)


def _has_room() -> ColumnElement[bool]:
    """A worker with room for a node: it owns no job and holds no node."""
    owns_job = exists().where(Job.worker_id == Worker.id, Job.status.in_(OWNED))
    holds_node = exists().where(NodeLease.worker_id == Worker.id)
    return ~owns_job & ~holds_node


def idle_peers(session: Session, *, fits: Callable[[Worker], bool], claimant: str) -> list[Worker]:
    """Live workers other than `claimant` that own no job, hold no node and can run a node (`fits`),
    in a stable order (their ids)."""
    free = select(Worker).where(Worker.id != claimant, _has_room()).order_by(Worker.id)
    return [w for w in session.scalars(free).all() if workers_db.is_alive(w) and fits(w)]


def with_room(session: Session) -> set[str]:
    """The workers (alive or not) that own no job and hold no node: where a node could go now."""
    return set(session.scalars(select(Worker.id).where(_has_room())))


def lock(session: Session, workers: list[str]) -> None:
    """Hold the rows of `workers` until the transaction ends (SELECT ... FOR UPDATE, in id order; SQLite
    leaves it out and needs none)."""
    session.execute(select(Worker.id).where(Worker.id.in_(workers)).order_by(Worker.id).with_for_update())


def taken(session: Session, *, claimant: str, peers: list[str]) -> set[str]:
    """Read after `lock`: of a claim's workers, those no longer free for it: the claimant or a peer leased
    as a node, or a peer that owns a job."""
    holding = select(NodeLease.worker_id).where(NodeLease.worker_id.in_([claimant, *peers]))
    if not peers:
        return set(session.scalars(holding))
    owning = select(Job.worker_id).where(Job.worker_id.in_(peers), Job.status.in_(OWNED))
    return {w for w in session.scalars(union(holding, owning)) if w is not None}


def reserve(
    session: Session,
    *,
    job_id: str,
    attempt: int,
    workers: list[str],
    endpoint: str,
    lease_seconds: float,
) -> None:
    """Lease `workers` (the claimant first: node 0) as the job's nodes, all or none: GangUnavailable
    when any of them is already held (the caller's transaction must then roll back)."""
    until = utcnow() + timedelta(seconds=lease_seconds)
    try:
        with session.begin_nested():
            session.add_all(
                NodeLease(
                    worker_id=w, job_id=job_id, attempt=attempt, rank=r, endpoint=endpoint, lease_until=until
                )
                for r, w in enumerate(workers)
            )
    except IntegrityError as e:
        raise GangUnavailable(f"a node of job {job_id} was leased by another job meanwhile") from e


def held_by(session: Session, worker_id: str) -> NodeLease | None:
    """The node this worker is leased as, if any."""
    return session.get(NodeLease, worker_id)


def nodes_of(session: Session, job_id: str) -> list[NodeLease]:
    return list(session.scalars(select(NodeLease).where(NodeLease.job_id == job_id).order_by(NodeLease.rank)))


def extend(session: Session, *, worker_id: str, job_id: str, attempt: int, lease_seconds: float) -> bool:
    """Renew a node's lease while its attempt is the job's running one. False: the node is no longer
    wanted (the attempt ended, was cancelled or lost), and its worker stops it."""
    running = exists().where(Job.id == job_id, Job.attempt == attempt, Job.status.in_(OWNED))
    result = session.execute(
        update(NodeLease)
        .where(NodeLease.worker_id == worker_id, NodeLease.job_id == job_id, NodeLease.attempt == attempt)
        .where(running)
        .values(lease_until=utcnow() + timedelta(seconds=lease_seconds))
        .execution_options(synchronize_session=False)
    )
    return rows_changed(result) == 1


def release(session: Session, *, job_id: str, attempt: int | None = None) -> int:
    """Free a job's nodes (of one attempt, or all): its workers may be placed again."""
    stmt = delete(NodeLease).where(NodeLease.job_id == job_id)
    if attempt is not None:
        stmt = stmt.where(NodeLease.attempt == attempt)
    return rows_changed(session.execute(stmt.execution_options(synchronize_session=False)))


def release_stale(session: Session, *, now: datetime | None = None) -> int:
    """The reaper's pass: free nodes whose lease ran out (their worker died) or whose attempt is no longer
    the job's running one (it finished, failed, or was requeued)."""
    now = now or utcnow()
    current = exists().where(
        Job.id == NodeLease.job_id, Job.attempt == NodeLease.attempt, Job.status.in_(OWNED)
    )
    stale = delete(NodeLease).where((NodeLease.lease_until < now) | ~current)
    return rows_changed(session.execute(stale.execution_options(synchronize_session=False)))
