"""The task layer (worker.tasks) on a real migrated database, with small doubles for what it is given:
the broker publisher (records what it would send), the token statistics computation, and, for the run
loop, a runner whose outcomes are scripted. The real worker process runs them in tests/e2e."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from cli.main import worker_argv
from core.data.token_stats import StatsRequest
from core.queues import CPU_QUEUE, QUEUE, QUEUE_OF, REAP, RUN_JOB, TOKEN_STATS, class_queue, worker_queue
from core.settings import Settings
from models import jobs as jobs_db
from models import workers as workers_db
from planner import BatchShape
from tests.worker.runner_env import job_in_db
from worker.celery_app import DELIVER_WEBHOOKS
from worker.devices import detect_devices
from worker.runner import JobRunner
from worker.tasks import Worker, create_worker_app

HERE = [{"name": "cpu", "kind": "cpu", "memory_bytes": 8 * 2**30}]
TOO_SMALL = [{"name": "cpu", "kind": "cpu", "memory_bytes": 2**20}]  # no plan of the tiny model fits
LARGE = [{"name": "cpu", "kind": "cpu", "memory_bytes": 2**40}]
READY = {"status": "ready", "count": 4, "p50": 10, "p95": 12, "max": 12, "over_max_seq_len": 0}


class Wake:
    """The broker publisher, recording what it would send."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def __call__(self, job_id: str) -> bool:
        return self.to(QUEUE_OF[RUN_JOB], job_id)

    def to(self, queue: str, job_id: str) -> bool:
        self.sent.append((queue, job_id))
        return True


class ScriptedRunner(JobRunner):
    """A JobRunner whose runs return `outcomes` in turn (and record the hint each was given)."""

    def __init__(self, *args: Any, outcomes: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes, self.hints = outcomes, list[str | None]()

    def run(self, hint: str | None = None) -> str:
        self.hints.append(hint)
        return self.outcomes.pop(0)


class Compute:
    def __init__(self, result: dict[str, Any] | None) -> None:
        self.result = result
        self.stops: list[threading.Event] = []

    def __call__(self, request: StatsRequest, stop: threading.Event) -> dict[str, Any] | None:
        self.stops.append(stop)
        return self.result


@pytest.fixture
def env(tmp_path: Path, migrated_url: str) -> Iterator[tuple[Settings, sessionmaker[Session], str]]:
    settings = {"plan_gpu": "T4", "resend_after_seconds": 0.001, "worker_name": "w-test"}
    with job_in_db(tmp_path, migrated_url, {"max_seq_len": 64}, settings) as made:
        yield made


def _worker(
    settings: Settings,
    sessions: sessionmaker[Session],
    *,
    devices: list[dict[str, Any]] = HERE,
    outcomes: list[str] | None = None,
    compute: Compute | None = None,
    depth: int | None = 0,
) -> tuple[Worker, Wake]:
    wake = Wake()
    runner = (
        ScriptedRunner(settings, sessions, wake, devices=devices, outcomes=outcomes)
        if outcomes is not None
        else JobRunner(settings, sessions, wake, devices=devices)
    )
    return Worker(settings, sessions, runner, wake, compute or Compute(READY), lambda: depth), wake


def test_a_wake_up_runs_the_jobs_the_fair_claim_picks_until_none_is_left(env) -> None:  # type: ignore[no-untyped-def]
    settings, sessions, job_id = env
    worker, wake = _worker(settings, sessions, outcomes=["succeeded", "failed", "skipped"])
    assert worker.run_next_fair_share_jobs(job_id) == "skipped"
    assert isinstance(worker.runner, ScriptedRunner)
    assert worker.runner.hints == [job_id, None, None]  # the message's job is a hint, not the choice
    assert wake.sent == []  # the job fits here: nothing passed on


def test_a_shutdown_ends_the_loop_after_the_running_job(env) -> None:  # type: ignore[no-untyped-def]
    settings, sessions, job_id = env
    worker, _ = _worker(settings, sessions, outcomes=["requeued", "succeeded"])
    worker.stopped()
    assert worker.runner.stopping.is_set()
    assert worker.run_next_fair_share_jobs(job_id) == "requeued"
    assert isinstance(worker.runner, ScriptedRunner) and worker.runner.outcomes == ["succeeded"]


def test_a_wake_up_for_a_job_too_big_here_goes_to_the_workers_it_fits(env) -> None:  # type: ignore[no-untyped-def]
    settings, sessions, job_id = env
    with sessions.begin() as s:
        workers_db.register(s, "large", "h", LARGE)
    worker, wake = _worker(settings, sessions, devices=TOO_SMALL, outcomes=["skipped"])
    assert worker.run_next_fair_share_jobs(job_id) == "skipped"
    assert wake.sent == [(class_queue(LARGE), job_id)]


def test_token_statistics_are_stored_and_a_replanned_job_is_woken_again(env) -> None:  # type: ignore[no-untyped-def]
    settings, sessions, job_id = env
    compute = Compute({**READY, **BatchShape(tokens=24, seq_len=12, targets=10).token_stats()})
    worker, wake = _worker(settings, sessions, compute=compute)
    assert worker.token_stats(job_id) == "replanned"
    assert compute.stops == [worker.stopping]  # a shutdown stops the computation
    assert wake.sent == [(QUEUE, job_id)]  # placement looks again at the smaller plan
    with sessions() as s:
        job = jobs_db.get_job(s, job_id)
        assert job is not None and job.token_stats["status"] == "ready"
    assert worker.token_stats(job_id) == "skipped" and len(compute.stops) == 1  # a redelivery


def test_token_statistics_stopped_by_a_shutdown_store_nothing_and_wake_no_one(env) -> None:  # type: ignore[no-untyped-def]
    settings, sessions, job_id = env
    worker, wake = _worker(settings, sessions, compute=Compute(None))
    assert worker.token_stats(job_id) == "stopped"
    assert wake.sent == []
    with sessions() as s:
        job = jobs_db.get_job(s, job_id)
        assert job is not None and job.token_stats == {"status": "pending"}


def test_a_trainer_joins_the_fleet_when_ready_and_leaves_it_on_shutdown(env) -> None:  # type: ignore[no-untyped-def]
    settings, sessions, _ = env
    worker, wake = _worker(settings, sessions, depth=None)  # queue depth unknown: nothing re-sent
    worker.started({QUEUE, class_queue(HERE), worker_queue("w-test")})
    assert worker.in_fleet.is_set()
    assert wake.sent == [(class_queue(HERE), "")]  # wakes itself for the jobs that waited for it
    with sessions() as s:
        (me,) = workers_db.fleet(s)
        assert me.id == "w-test" and me.devices == HERE and workers_db.is_alive(me)
    worker.stopped()  # also ends the tick thread
    assert worker.stopping.is_set()
    with sessions() as s:
        (me,) = workers_db.list_workers(s)
        assert not workers_db.is_alive(me)


def test_a_cpu_worker_stays_out_of_the_fleet(env) -> None:  # type: ignore[no-untyped-def]
    settings, sessions, _ = env
    worker, wake = _worker(settings, sessions, depth=None)
    worker.started({CPU_QUEUE})
    worker.stopped()
    assert not worker.in_fleet.is_set() and wake.sent == []
    with sessions() as s:
        assert workers_db.list_workers(s) == []


def test_the_reaper_resends_a_queued_job_whose_message_is_lost(env) -> None:  # type: ignore[no-untyped-def]
    settings, sessions, job_id = env
    worker, _ = _worker(settings, sessions, depth=None)
    assert worker.reap_now() == {"requeued": 0, "failed": 0, "resent": 0}  # depth unknown: no re-send
    worker, wake = _worker(settings, sessions, depth=0)
    assert worker.reap_now() == {"requeued": 0, "failed": 0, "resent": 1}
    assert wake.sent == [(QUEUE, job_id)]


def test_the_app_registers_the_tasks_under_the_names_the_api_publishes(tmp_path: Path) -> None:
    app = create_worker_app(Settings(data_dir=tmp_path / "data", redis_url=""))  # connects to nothing
    ours = {name: task for name, task in app.tasks.items() if name.startswith("ftune.")}
    assert set(ours) == {RUN_JOB, TOKEN_STATS, REAP, DELIVER_WEBHOOKS}
    assert ours[RUN_JOB].acks_late and ours[TOKEN_STATS].acks_late
    assert ours[RUN_JOB].run.__name__ == "run_next_fair_share_jobs"
    assert app.conf.task_routes[TOKEN_STATS] == {"queue": CPU_QUEUE}


def test_a_trainer_consumes_its_own_queue_from_its_command_line() -> None:
    """`ftune worker`'s Celery command line: a trainer on the shared queue, its device class's and its own
    (the wake-ups of the nodes it is leased as), under the id its runner then reads; a CPU worker on the
    CPU queue alone. An unnamed worker gets a name once, and keeps Celery's hostname (health checks)."""
    named = Settings(worker_name="w-a", worker_devices="cpu:16GiB")
    argv = worker_argv(named, cpu=False, concurrency=None)
    devices = detect_devices("cpu:16GiB")
    assert f"--queues={QUEUE},{class_queue(devices)},{worker_queue('w-a')}" in argv
    assert "--hostname=w-a" in argv and named.worker_name == "w-a"
    unnamed = Settings(worker_name="", worker_devices="cpu:16GiB")
    argv = worker_argv(unnamed, cpu=False, concurrency=None)
    queues = next(a for a in argv if a.startswith("--queues=")).split(",")
    assert unnamed.worker_name and queues[-1] == worker_queue(unnamed.worker_name)
    assert not any(a.startswith("--hostname") for a in argv)
    cpu = worker_argv(Settings(worker_name="w-a"), cpu=True, concurrency=None)
    assert f"--queues={CPU_QUEUE}" in cpu and "--concurrency=1" in cpu and "--hostname=w-a-cpu" in cpu
