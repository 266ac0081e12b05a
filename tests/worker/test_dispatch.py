"""Passing a wake-up on (worker.dispatch) on SQLite and PostgreSQL: a worker that cannot run the job wakes
the class queues of the live workers that can, or records once why the job waits; a job it fits is left
to its own claim."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from core.queues import class_queue
from models import jobs as jobs_db
from models import workers as workers_db
from models.db import session_scope
from models.placement import Placer
from tests.models.test_fairshare_db import CPU_1T, CPU_8G, _submit, placer, sessions  # noqa: F401
from worker.dispatch import pass_on, refresh_waiting

CPU_8G_B = [{"name": "cpu", "kind": "cpu", "memory_bytes": 8 * 2**30 + 1}]


def _waiting(sessions: sessionmaker[Session], job_id: str) -> list[str]:  # noqa: F811
    with sessions() as s:
        job = jobs_db.get_job(s, job_id)
        assert job is not None
        return [e.message for e in job.events if e.kind == "waiting"]


def test_a_job_that_does_not_fit_wakes_the_workers_that_fit_or_says_why(
    sessions: sessionmaker[Session],  # noqa: F811
    placer: Placer,  # noqa: F811
) -> None:
    (big,) = _submit(sessions, "aaa", 1, base_model="big")
    (small,) = _submit(sessions, "bbb", 1)
    sent: list[tuple[str, str]] = []

    def send(queue: str, job_id: str) -> bool:
        sent.append((queue, job_id))
        return True

    with session_scope(sessions) as s:
        workers_db.register(s, "small-1", "h", CPU_8G)
        workers_db.register(s, "small-2", "h", CPU_8G_B)
    assert pass_on(sessions, placer, CPU_8G, small, send) == [] and sent == []  # fits here: claim it
    assert pass_on(sessions, placer, CPU_8G, big, send) == [] and sent == []  # fits no live worker
    reasons = _waiting(sessions, big)
    assert len(reasons) == 1 and reasons[0].endswith("GiB per device, 0 alive of 2")
    assert refresh_waiting(sessions, placer) == 0  # the same reason is not recorded twice

    with session_scope(sessions) as s:
        workers_db.register(s, "large", "h", CPU_1T)
        workers_db.mark_stopped(s, "large")
    assert refresh_waiting(sessions, placer) == 1  # the reason changed: a worker that fits, stopped
    assert _waiting(sessions, big)[-1].endswith("0 alive of 2; 1 that fit not alive")

    with session_scope(sessions) as s:
        workers_db.register(s, "large", "h", CPU_1T)  # back
    assert pass_on(sessions, placer, CPU_8G, big, send) == [class_queue(CPU_1T)]
    assert sent == [(class_queue(CPU_1T), big)]
    assert refresh_waiting(sessions, placer) == 0
