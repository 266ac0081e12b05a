"""Aggregate queries for the dashboard and /metrics: counts by status, finished durations, throughput."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import Float, case, func, select
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from core.states import TERMINAL, JobStatus
from models.tables import Job, Tenant


def counts_by_status(session: Session, tenant_id: str | None = None) -> dict[str, int]:
    """Every status, zeros included, so a dashboard or a Prometheus series never disappears."""
    stmt = select(Job.status, func.count()).group_by(Job.status)
    if tenant_id is not None:
        stmt = stmt.where(Job.tenant_id == tenant_id)
    counts = {str(s): 0 for s in JobStatus}
    for status, n in session.execute(stmt).all():
        counts[status] = int(n)
    return counts


class Durations(NamedTuple):
    """A histogram of run times: `le[i]` jobs took at most `bounds[i]` seconds; `jobs` in all."""

    jobs: int
    total_seconds: float
    le: list[int]


def finished_durations(session: Session, bounds: Sequence[float]) -> dict[str, Durations]:
    """Run time (start to finish, at least 0) of the terminal jobs that ran, by status, counted in SQL:
    one row per status however many jobs have finished."""
    seconds = _seconds_between(Job.started_at, Job.finished_at)
    ran = (
        select(Job.status.label("status"), case((seconds < 0, 0.0), else_=seconds).label("seconds"))
        .where(
            Job.status.in_([str(s) for s in TERMINAL]),
            Job.started_at.is_not(None),
            Job.finished_at.is_not(None),
        )
        .subquery()
    )
    le = [func.sum(case((ran.c.seconds <= b, 1), else_=0)) for b in bounds]
    stmt = select(ran.c.status, func.count(), func.sum(ran.c.seconds), *le).group_by(ran.c.status)
    return {
        status: Durations(int(n), float(total), [int(c) for c in counts])
        for status, n, total, *counts in session.execute(stmt).all()
    }


class _seconds_between(FunctionElement[float]):
    """end - start in seconds, to the microsecond, on each backend."""

    type = Float()
    inherit_cache = True


@compiles(_seconds_between)
def _seconds_between_sql(element: _seconds_between, compiler: SQLCompiler, **kw: Any) -> str:
    start, end = (compiler.process(c, **kw) for c in element.clauses)
    return f"EXTRACT(EPOCH FROM ({end} - {start}))"


@compiles(_seconds_between, "sqlite")
def _seconds_between_sqlite(element: _seconds_between, compiler: SQLCompiler, **kw: Any) -> str:
    # Stored as 'YYYY-MM-DD HH:MM:SS.ffffff'. julianday() keeps milliseconds only, so the whole
    # seconds and the fractions are subtracted apart.
    start, end = (compiler.process(c, **kw) for c in element.clauses)
    whole = "CAST(strftime('%s', substr({0}, 1, 19)) AS INTEGER)"
    frac = "CAST(substr({0}, 20) AS REAL)"
    return f"(({whole.format(end)} - {whole.format(start)}) + ({frac.format(end)} - {frac.format(start)}))"


def running_throughput(session: Session) -> list[tuple[str, str, float]]:
    """(job id, worker id, tokens/s) of running jobs that have reported a step."""
    rows = session.execute(
        select(Job.id, Job.worker_id, Job.tokens_per_s).where(
            Job.status == JobStatus.RUNNING, Job.tokens_per_s.is_not(None)
        )
    ).all()
    return [(job_id, worker or "", float(tps or 0.0)) for job_id, worker, tps in rows]


def tenant_names(session: Session) -> dict[str, str]:
    return {t.id: t.name for t in session.scalars(select(Tenant)).all()}
