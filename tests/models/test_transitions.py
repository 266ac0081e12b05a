"""The job state machine on a real database: every transition the table lacks is refused, every one it
has is a compare-and-set that a concurrent or stale writer loses; pause and resume walk it."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy.orm import Session, sessionmaker

from core.spec import JobSpec
from core.states import OWNED, TERMINAL, TRANSITIONS, IllegalTransition, JobStatus, can_transition
from models import datasets as datasets_db
from models import jobs as jobs_db
from models.db import make_engine, make_session_factory, session_scope
from models.tables import Job, utcnow
from models.tenants import get_or_create_tenant
from models.transitions import transition

REPORT = {"valid": True, "format": "instruction", "num_examples": 3, "size_bytes": 10, "sha256": "0" * 64}
ALL = list(JobStatus)
_ids = itertools.count()


@pytest.fixture
def sessions(migrated_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(migrated_url)
    with session_scope(make_session_factory(engine)) as s:
        tenant = get_or_create_tenant(s, "t")
        datasets_db.create_dataset(s, tenant.id, "ds000001", "a.jsonl", REPORT)
    yield make_session_factory(engine)
    engine.dispose()


def _queued(sessions: sessionmaker[Session]) -> str:
    job_id = f"job{next(_ids):08d}"
    with session_scope(sessions) as s:
        tenant = get_or_create_tenant(s, "t")
        jobs_db.create_job(s, tenant.id, job_id, JobSpec(base_model="m", dataset_id="ds000001"))
    return job_id


def _job_in(sessions: sessionmaker[Session], status: JobStatus) -> str:
    """A job brought to `status` through the public queries only (never a raw status write)."""
    job_id = _queued(sessions)
    with session_scope(sessions) as s:
        if status == JobStatus.PAUSED:
            assert jobs_db.request_pause(s, job_id=job_id)
        elif status == JobStatus.CANCELLED:
            assert jobs_db.request_cancel(s, job_id=job_id) == "cancelled"
        elif status != JobStatus.QUEUED:
            assert jobs_db.claim(s, job_id=job_id, worker_id="w1", lease_seconds=60) == 1
            if status == JobStatus.PAUSING:
                assert jobs_db.request_pause(s, job_id=job_id)
            elif status in (JobStatus.SUCCEEDED, JobStatus.FAILED):
                assert jobs_db.finish(s, job_id=job_id, attempt=1, dst=status, message="end") == status
    assert _status(sessions, job_id) == status
    return job_id


def _status(sessions: sessionmaker[Session], job_id: str) -> str:
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None
        return job.status


def _events(sessions: sessionmaker[Session], job_id: str) -> list[str]:
    with sessions() as s:
        return [e.kind for e in jobs_db.list_events(s, job_id, 0, 100)[0]]


def test_the_table_has_pause_and_resume_and_terminal_states_are_final() -> None:
    assert can_transition(JobStatus.RUNNING, JobStatus.PAUSING)
    assert can_transition(JobStatus.PAUSING, JobStatus.PAUSED)
    assert can_transition(JobStatus.QUEUED, JobStatus.PAUSED)
    assert can_transition(JobStatus.PAUSED, JobStatus.QUEUED)
    assert can_transition(JobStatus.PAUSED, JobStatus.CANCELLED)
    assert all(not TRANSITIONS[t] for t in TERMINAL)
    assert set(TRANSITIONS) == set(JobStatus)


@pytest.mark.parametrize("src", ALL)
def test_every_transition_the_table_lacks_is_refused(sessions: sessionmaker[Session], src: JobStatus) -> None:
    job_id = _job_in(sessions, src)
    with sessions() as s:
        before = s.get(Job, job_id)
        assert before is not None
        updated_at = before.updated_at
    refused = [dst for dst in ALL if dst not in TRANSITIONS[src]]
    assert src in refused  # no self-loops: a status write that changes nothing is a bug too
    for dst in refused:
        with session_scope(sessions) as s, pytest.raises(IllegalTransition, match=f"from {src} to {dst}"):
            transition(s, job_id=job_id, src=src, dst=dst)
    with sessions() as s:
        after = s.get(Job, job_id)
        assert after is not None and (after.status, after.updated_at) == (src, updated_at)


@pytest.mark.parametrize(("src", "dst"), [(a, b) for a in ALL for b in sorted(TRANSITIONS[a])])
def test_every_allowed_transition_is_a_compare_and_set(
    sessions: sessionmaker[Session], src: JobStatus, dst: JobStatus
) -> None:
    job_id = _job_in(sessions, src)
    with session_scope(sessions) as s:
        assert not transition(s, job_id=job_id, src=src, dst=dst, attempt=7)  # a stale attempt loses
        assert transition(s, job_id=job_id, src=src, dst=dst, event=("moved", f"{src} -> {dst}", None))
        assert not transition(s, job_id=job_id, src=src, dst=dst)  # it is no longer in src: a no-op
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == dst
        assert (job.finished_at is not None) == (dst in TERMINAL)
        if dst not in OWNED:
            assert job.lease_until is None  # nothing left for the reaper to watch
    assert _events(sessions, job_id).count("moved") == 1


def test_cas_loses_to_a_concurrent_writer(sessions: sessionmaker[Session]) -> None:
    """A worker's claim holds the row (uncommitted) while a cancel races it: the cancel waits, then finds
    the job no longer queued and changes nothing."""
    job_id = _queued(sessions)
    result: list[bool] = []

    def cancel() -> None:
        with session_scope(sessions) as s:
            moved = transition(
                s,
                job_id=job_id,
                src=JobStatus.QUEUED,
                dst=JobStatus.CANCELLED,
                values={"cancel_requested": True},
            )
            result.append(moved)

    with session_scope(sessions) as claimer:
        assert jobs_db.claim(claimer, job_id=job_id, worker_id="w1", lease_seconds=60) == 1
        racer = threading.Thread(target=cancel)
        racer.start()
        time.sleep(0.5)
        assert racer.is_alive(), "the concurrent write should wait for the claim's transaction"
    racer.join(30)
    assert result == [False]
    assert _status(sessions, job_id) == JobStatus.RUNNING
    assert _events(sessions, job_id) == ["queued", "started"]


def test_pause_a_queued_job_then_resume_it(sessions: sessionmaker[Session]) -> None:
    job_id = _queued(sessions)
    with session_scope(sessions) as s:
        assert jobs_db.request_pause(s, job_id=job_id)
        assert not jobs_db.request_pause(s, job_id=job_id)  # already paused
        assert jobs_db.claim(s, job_id=job_id, worker_id="w1", lease_seconds=60) is None  # its message
        assert jobs_db.resume(s, job_id=job_id)
        assert not jobs_db.resume(s, job_id=job_id)  # queued, not paused
        assert jobs_db.claim(s, job_id=job_id, worker_id="w1", lease_seconds=60) == 1
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None and job.max_attempts == 4  # the pause did not use up a retry
    assert _events(sessions, job_id) == ["queued", "paused", "resumed", "started"]


def test_pause_a_running_job(sessions: sessionmaker[Session]) -> None:
    job_id = _job_in(sessions, JobStatus.RUNNING)
    with session_scope(sessions) as s:
        assert jobs_db.request_pause(s, job_id=job_id)
        assert jobs_db.stop_wanted(s, job_id=job_id)
        # The attempt still owns the job while it checkpoints: progress is recorded.
        assert jobs_db.heartbeat(s, job_id=job_id, attempt=1, lease_seconds=60, step=3)
        # Its run stopped at a checkpoint: what would have requeued it pauses it.
        to = jobs_db.finish(s, job_id=job_id, attempt=1, dst=JobStatus.QUEUED, message="stopped")
        assert to == JobStatus.PAUSED
        assert not jobs_db.heartbeat(s, job_id=job_id, attempt=1, lease_seconds=60)  # no longer owned
    assert _events(sessions, job_id) == ["queued", "started", "pause_requested", "paused"]


def test_a_pausing_job_may_still_finish_or_be_cancelled(sessions: sessionmaker[Session]) -> None:
    done, cancelled = _job_in(sessions, JobStatus.PAUSING), _job_in(sessions, JobStatus.PAUSING)
    with session_scope(sessions) as s:
        # The run finished its last step before the stop reached it.
        assert (
            jobs_db.finish(s, job_id=done, attempt=1, dst=JobStatus.SUCCEEDED, message="done") == "succeeded"
        )
        assert jobs_db.request_cancel(s, job_id=cancelled) == "cancelling"
        assert not jobs_db.request_pause(s, job_id=cancelled)
        to = jobs_db.finish(s, job_id=cancelled, attempt=1, dst=JobStatus.CANCELLED, message="cancelled")
        assert to == JobStatus.CANCELLED


def test_pause_is_refused_where_the_state_does_not_allow_it(sessions: sessionmaker[Session]) -> None:
    for status in (JobStatus.PAUSING, JobStatus.PAUSED, *TERMINAL):
        job_id = _job_in(sessions, status)
        with session_scope(sessions) as s:
            assert not jobs_db.request_pause(s, job_id=job_id), status
            assert jobs_db.resume(s, job_id=job_id) == (status == JobStatus.PAUSED), status
    cancelling = _job_in(sessions, JobStatus.RUNNING)
    with session_scope(sessions) as s:
        assert jobs_db.request_cancel(s, job_id=cancelling) == "cancelling"
        assert not jobs_db.request_pause(s, job_id=cancelling)  # being cancelled already


def test_cancel_a_paused_job(sessions: sessionmaker[Session]) -> None:
    job_id = _job_in(sessions, JobStatus.PAUSED)
    with session_scope(sessions) as s:
        assert jobs_db.request_cancel(s, job_id=job_id) == "cancelled"
        assert not jobs_db.resume(s, job_id=job_id)
    assert _status(sessions, job_id) == JobStatus.CANCELLED


def test_a_lost_worker_while_pausing_leaves_the_job_paused(sessions: sessionmaker[Session]) -> None:
    pausing, running = _job_in(sessions, JobStatus.PAUSING), _job_in(sessions, JobStatus.RUNNING)
    later = utcnow() + timedelta(seconds=120)
    with sessions() as first, sessions() as second:  # two reapers find the same expired leases
        found = [{j.id: j for j in jobs_db.expired_leases(r, now=later)} for r in (first, second)]
        assert set(found[0]) == set(found[1]) == {pausing, running}
        assert jobs_db.release_expired(first, job=found[0][pausing]) == JobStatus.PAUSED
        assert jobs_db.release_expired(first, job=found[0][running]) == JobStatus.QUEUED
        first.commit()
        assert jobs_db.release_expired(second, job=found[1][running]) is None  # the second one loses
        assert jobs_db.release_expired(second, job=found[1][pausing]) is None
    assert _events(sessions, pausing)[-1] == "paused" and _events(sessions, running)[-1] == "retried"
