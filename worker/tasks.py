"""Celery tasks: translate a message into a call, nothing more.

`create_worker_app(settings)` builds the worker's app: the tasks below registered on it under the names
the API publishes (core.queues), and the worker's start and shutdown hooks. What the tasks of one app
share (the job runner, the database, the broker publisher, the shutdown flag) is a `Worker`, built on
first use; tests build one from doubles and call its methods. `celery -A worker.tasks` and `ftune worker`
take this module's `app`: the app of this process's settings, built when first asked for.

Tasks:
  ftune.run_job           run_next_fair_share_jobs: the jobs this worker can run, by the fair policy;
                          on a trainer's own queue, first the node of a multi-node job it is leased as
  ftune.token_stats       token_stats: a job's token statistics (the CPU worker; models.token_stats)
  ftune.reap              reap_now: jobs of dead workers back to the queue, lost wake-ups re-sent
  ftune.deliver_webhooks  deliver_webhooks: the webhook events that are due (the outbox)
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any, Protocol

from celery import Celery
from celery.signals import worker_ready, worker_shutting_down
from sqlalchemy.orm import Session, sessionmaker

from core.data.token_stats import Compute
from core.queues import QUEUE, REAP, RUN_JOB, TOKEN_STATS, Enqueuer, class_queue, worker_queue
from core.settings import Settings, get_settings
from models import workers as workers_db
from models.db import make_engine, make_session_factory, session_scope
from models.token_stats import compute_and_store, worker_compute
from worker.celery_app import DELIVER_WEBHOOKS, create_celery
from worker.dispatch import pass_on, refresh_waiting
from worker.forking import ForkServer
from worker.reaper import reap, release_predecessor
from worker.runner import JobRunner
from worker.webhooks import Deliverer

log = logging.getLogger(__name__)


class Wake(Protocol):
    """A job's wake-up (core.queues.Enqueuer): on the shared queue, or .to() a class queue."""

    def __call__(self, job_id: str) -> bool: ...
    def to(self, queue: str, job_id: str) -> bool: ...


class Worker:
    """What the tasks of one worker process share. `runner` runs jobs (worker.runner.JobRunner); `wake`
    publishes a wake-up; `compute` measures token statistics; `queue_depth` counts the messages waiting
    (None: unknown); `stopping` is set when the process shuts down; `in_fleet` once it has registered
    as a trainer (a CPU worker does not)."""

    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        runner: JobRunner,
        wake: Wake,
        compute: Compute,
        queue_depth: Callable[[], int | None],
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.runner = runner
        self.wake = wake
        self.compute = compute
        self.queue_depth = queue_depth
        self.stopping = runner.stopping
        self.in_fleet = threading.Event()
        self.webhooks = Deliverer(sessions, settings)  # its own threads, apart from the tick

    def run_next_fair_share_jobs(self, woken_for: str) -> str:
        """A wake-up for the job `woken_for`. Pass it on if that job does not fit here; then claim and
        run, by the fair policy, the jobs this worker can run (the woken-for job, or another) until none
        is left, so a busy worker needs no message for its next job. Returns the last outcome."""
        r = self.runner
        pass_on(self.sessions, r.placer, r.devices, woken_for, self.wake.to)
        outcome = r.run(woken_for)
        while outcome != "skipped" and not self.stopping.is_set():
            outcome = r.run()
        return outcome

    def token_stats(self, job_id: str) -> str:
        """Measure and store a job's token statistics (models.token_stats); a shutdown kills the
        computation (training's start fills them then). A job re-planned smaller is woken again."""
        r = self.runner
        outcome = compute_and_store(
            self.sessions,
            catalog=r.catalog,
            storage=r.storage,
            compute=self.compute,
            job_id=job_id,
            stop=self.stopping,
            plan_gpu=self.settings.plan_gpu,
        )
        if outcome == "replanned":  # a smaller plan may fit workers it did not: placement looks again
            self.wake(job_id)
        return outcome

    def reap_now(self) -> dict[str, int]:
        return reap(self.sessions, self.runner.enqueue, self.queue_depth, self.settings.resend_after_seconds)

    def deliver_webhooks(self) -> int:
        """Send the webhook events that are due (the outbox) and wait for them; every worker's tick starts
        such a pass in the delivery pool without waiting."""
        return self.webhooks.run_pass()

    def tick(self) -> None:
        """The periodic pass: a trainer's heartbeat and waiting reasons, then the reaper; webhooks are
        handed to their pool (never waited on: a stalled receiver does not delay the heartbeat)."""
        if self.in_fleet.is_set():
            with session_scope(self.sessions) as s:
                workers_db.heartbeat(s, self.runner.me)
            refresh_waiting(self.sessions, self.runner.placer)  # a job no live worker fits says why
            self.runner.start_reserved_node()  # leased as a node of another worker's multi-node job
        self.reap_now()
        self.webhooks.poke()

    def started(self, queues: set[str]) -> None:
        """The worker process is ready, consuming `queues`: a trainer (also on its own queue, for the
        wake-ups of the nodes it is leased as: cli.main.worker_argv) joins the fleet the planner admits
        against (a CPU worker does not), takes back its predecessor's jobs and wakes itself; every worker
        reaps once and starts its tick."""
        r = self.runner
        if QUEUE in queues:
            if worker_queue(r.me) not in queues:
                log.warning(
                    "worker %s does not consume %s: its nodes start on its tick", r.me, worker_queue(r.me)
                )
            with session_scope(self.sessions) as s:
                workers_db.register(s, r.me, socket.gethostname(), r.devices)
            self.in_fleet.set()
            release_predecessor(self.sessions, r.me, r.enqueue)
            log.info("worker %s registered with devices %s (%s)", r.me, r.devices, class_queue(r.devices))
            self.wake.to(class_queue(r.devices), "")  # wake myself: jobs that waited for a worker like me
        self.reap_now()  # at start: jobs of a worker that died while we were down
        interval = self.settings.reaper_interval_seconds
        threading.Thread(target=self._tick_forever, args=(interval,), daemon=True).start()

    def stopped(self) -> None:
        """The process is shutting down: running jobs checkpoint, stop and go back to the queue instead
        of blocking shutdown for hours; a trainer leaves the fleet."""
        self.stopping.set()
        self.webhooks.close()
        if self.in_fleet.is_set():
            with session_scope(self.sessions) as s:
                workers_db.mark_stopped(s, self.runner.me)

    def _tick_forever(self, interval: float) -> None:
        while not self.stopping.wait(interval):
            try:
                self.tick()
            except Exception:
                log.exception("worker heartbeat or reaper pass failed")


def build_worker(settings: Settings, app: Celery) -> Worker:
    """The Worker of a process: its database, this app's publisher, the real token statistics."""
    sessions = make_session_factory(make_engine(settings.resolved_database_url))
    wake = Enqueuer(app.send_task, RUN_JOB)
    forks = ForkServer() if settings.fork_training else None
    runner = JobRunner(settings, sessions, wake, forks=forks, wake_on=wake.to)

    def queue_depth() -> int | None:
        """Messages waiting in the shared jobs queue and the class queues of the fleet."""
        try:
            with session_scope(sessions) as s:
                queues = {QUEUE} | {class_queue(w.devices) for w in workers_db.fleet(s)}
            with app.connection_for_write() as conn:
                client = conn.default_channel.client
                return sum(int(client.llen(q)) for q in queues)
        except Exception:
            return None  # unknown: do not re-send

    compute = worker_compute(settings)
    return Worker(settings, sessions, runner, wake, compute, queue_depth)


def create_worker_app(settings: Settings) -> Celery:
    """The worker's Celery app for `settings`, its tasks registered. Building it connects to nothing;
    the Worker is built on the first task or when the worker process is ready."""
    app = create_celery(settings)
    worker = functools.cache(lambda: build_worker(settings, app))

    @app.task(name=RUN_JOB, acks_late=True)
    def run_next_fair_share_jobs(job_id: str) -> str:
        return worker().run_next_fair_share_jobs(job_id)

    @app.task(name=TOKEN_STATS, acks_late=True)
    def token_stats(job_id: str) -> str:
        return worker().token_stats(job_id)

    @app.task(name=REAP)
    def reap_now() -> dict[str, int]:
        return worker().reap_now()

    @app.task(name=DELIVER_WEBHOOKS)
    def deliver_webhooks() -> int:
        return worker().deliver_webhooks()

    @worker_ready.connect(weak=False)
    def on_ready(sender: Any = None, **_: Any) -> None:
        if sender is not None and sender.app is not app:
            return  # another app's worker (only where one process builds several)
        worker().started(set(sender.app.amqp.queues.consume_from) if sender is not None else {QUEUE})

    @worker_shutting_down.connect(weak=False)
    def on_shutdown(**_: Any) -> None:
        worker().stopped()

    return app


@functools.cache
def default_app() -> Celery:
    """The app of this process's settings (`celery -A worker.tasks`, `ftune worker`), built once."""
    return create_worker_app(get_settings())


def reap_now() -> dict[str, int]:
    """One reaper pass with this process's settings (`ftune reaper`), as the ftune.reap task makes it."""
    result: dict[str, int] = default_app().tasks[REAP]()
    return result


def __getattr__(name: str) -> Any:
    if name == "app":  # `celery -A worker.tasks` and `from worker.tasks import app`
        return default_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
