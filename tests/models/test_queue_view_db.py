"""Queue position and estimated start of queued jobs, on SQLite and PostgreSQL: the fair order played out
on the live workers that can run each job, with their running jobs' ETAs and a typical run time."""

# ruff: noqa: F811 (the fixtures are imported)
from __future__ import annotations

from datetime import timedelta

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from models import jobs as jobs_db
from models import workers as workers_db
from models.db import session_scope
from models.placement import Placer
from models.queue_view import queue_view
from models.tables import Job, utcnow
from tests.models.test_fairshare_db import CPU_1T, CPU_8G, _claim, _submit, placer, sessions  # noqa: F401


def _set_eta(sessions: sessionmaker[Session], job_id: str, eta: float, worker: str) -> None:
    with session_scope(sessions) as s:
        s.execute(update(Job).where(Job.id == job_id).values(eta_seconds=eta))
        workers_db.set_current_job(s, worker, job_id)


def test_positions_and_starts_follow_the_fair_order_on_the_workers_that_fit(
    sessions: sessionmaker[Session],
    placer: Placer,
) -> None:
    with session_scope(sessions) as s:
        workers_db.register(s, "small", "h", CPU_8G)
    # a finished run of 100 s: the typical duration
    (done,) = _submit(sessions, "zzz", 1)
    assert _claim(sessions, placer, CPU_8G) == done
    t = utcnow()
    with session_scope(sessions) as s:
        s.execute(
            update(Job)
            .where(Job.id == done)
            .values(status="succeeded", started_at=t - timedelta(seconds=100), finished_at=t)
        )
    running = _submit(sessions, "aaa", 1)[0]
    assert _claim(sessions, placer, CPU_8G) == running
    _set_eta(sessions, running, 30, "small")
    a = _submit(sessions, "aaa", 2)
    (b,) = _submit(sessions, "bbb", 1)
    (big,) = _submit(sessions, "ccc", 1, base_model="big")
    now = utcnow()
    with sessions() as s:
        view = queue_view(s, placer, now)
    # bbb has nothing running: it goes first; then aaa's two, one run (100 s) apart
    assert [view[j].position for j in (b, a[0], a[1])] == [1, 2, 3]
    assert view[b].estimated_start == now + timedelta(seconds=30)
    assert view[a[0]].estimated_start == now + timedelta(seconds=130)
    assert view[a[1]].estimated_start == now + timedelta(seconds=230)
    assert view[big].position is None and view[big].estimated_start is None
    assert (view[big].waiting_reason or "").startswith("waiting for a worker with >= ")
    # a second, idle worker that fits everything: the big job is next there, and starts now
    with session_scope(sessions) as s:
        workers_db.register(s, "large", "h", CPU_1T)
    with sessions() as s:
        view = queue_view(s, placer, now)
    assert view[big].waiting_reason is None
    assert view[b].estimated_start == now and view[b].position == 1
    assert {view[j].position for j in (a[0], a[1], big)} == {2, 3, 4}
    assert all(view[j].estimated_start is not None for j in (a[0], a[1], big))


def test_without_history_only_a_start_on_an_idle_worker_is_estimated(
    sessions: sessionmaker[Session],
    placer: Placer,
) -> None:
    with session_scope(sessions) as s:
        workers_db.register(s, "w", "h", CPU_8G)
    first, second = _submit(sessions, "aaa", 2)
    now = utcnow()
    with sessions() as s:
        view = queue_view(s, placer, now)
        assert jobs_db.get_job(s, first) is not None
    assert (view[first].position, view[first].estimated_start) == (1, now)
    assert (view[second].position, view[second].estimated_start) == (2, None)
