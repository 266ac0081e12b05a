"""Celery tasks: translate a message into a call, nothing more."""

from __future__ import annotations

import logging
import threading
from functools import lru_cache
from typing import Any

from celery.signals import worker_ready, worker_shutting_down

from core.queues import TOKEN_STATS, Enqueuer, class_queue
from core.settings import get_settings
from models import workers as workers_db
from models.db import make_engine, make_session_factory, session_scope
from models.token_stats import compute_and_store, subprocess_compute
from worker import runner
from worker.celery_app import DELIVER_WEBHOOKS, QUEUE, REAP, RUN_JOB, app
from worker.dispatch import pass_on, refresh_waiting
from worker.reaper import reap, release_predecessor
from worker.webhooks import deliver_due

log = logging.getLogger(__name__)

_wake = Enqueuer(app.send_task, RUN_JOB)  # a job's wake-up: on the shared queue, or .to() a class queue

# Set when this process serves the training queue and so is in the fleet table (a CPU worker is not).
_in_fleet = threading.Event()


@lru_cache
def _runner() -> runner.JobRunner:
    settings = get_settings()
    sessions = make_session_factory(make_engine(settings.resolved_database_url))
    return runner.JobRunner(settings, sessions, _wake)


def _fleet_pass() -> None:
    r = _runner()
    refresh_waiting(r.sessions, r.placer)


def _queue_depth() -> int | None:
    """Messages waiting in the shared jobs queue and the class queues of the fleet."""
    r = _runner()
    try:
        with session_scope(r.sessions) as s:
            queues = {QUEUE} | {class_queue(w.devices) for w in workers_db.fleet(s)}
        with app.connection_for_write() as conn:
            client = conn.default_channel.client
            return sum(int(client.llen(q)) for q in queues)
    except Exception:
        return None  # unknown: do not re-send


@app.task(name=RUN_JOB, acks_late=True)
def run_job(job_id: str) -> str:
    """A wake-up. Pass it on if its job does not fit here; then claim and run, by the fair policy, the
    jobs this worker can run until none is left (so a busy worker needs no message for its next job)."""
    r = _runner()
    pass_on(r.sessions, r.placer, r.devices, job_id, _wake.to)
    outcome = r.run(job_id)
    while outcome != "skipped" and not runner.shutting_down.is_set():
        outcome = r.run()
    return outcome


@app.task(name=TOKEN_STATS, acks_late=True)
def token_stats(job_id: str) -> str:
    r = _runner()
    compute = subprocess_compute(r.settings.token_stats_timeout_seconds)
    stop = runner.shutting_down  # a shutdown kills the computation; training's start fills them then
    outcome = compute_and_store(
        r.sessions,
        catalog=r.catalog,
        storage=r.storage,
        compute=compute,
        job_id=job_id,
        stop=stop,
        plan_gpu=r.settings.plan_gpu,
    )
    if outcome == "replanned":  # a smaller plan may fit workers it did not: placement looks again
        _wake(job_id)
    return outcome


@app.task(name=REAP)
def reap_now() -> dict[str, int]:
    r = _runner()
    return reap(r.sessions, r.enqueue, _queue_depth, r.settings.resend_after_seconds)


@app.task(name=DELIVER_WEBHOOKS)
def deliver_webhooks() -> int:
    """Send the webhook events that are due (the outbox); every worker's tick runs this too."""
    r = _runner()
    return deliver_due(r.sessions, r.settings)


def _tick() -> None:
    r = _runner()
    if _in_fleet.is_set():
        with session_scope(r.sessions) as s:
            workers_db.heartbeat(s, r.me)
        _fleet_pass()  # a job no live worker fits says why (the fleet may have changed)
    reap_now()
    deliver_webhooks()


def _tick_forever(stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        try:
            _tick()
        except Exception:
            log.exception("worker heartbeat or reaper pass failed")


@worker_ready.connect
def _on_ready(sender: Any = None, **_: Any) -> None:
    r = _runner()
    queues = set(sender.app.amqp.queues.consume_from) if sender is not None else {QUEUE}
    if QUEUE in queues:  # a trainer joins the fleet the planner admits against; a CPU worker does not
        with session_scope(r.sessions) as s:
            workers_db.register(s, r.me, runner.socket.gethostname(), r.devices)
        _in_fleet.set()
        release_predecessor(r.sessions, r.me, r.enqueue)
        log.info("worker %s registered with devices %s (%s)", r.me, r.devices, class_queue(r.devices))
        _wake.to(class_queue(r.devices), "")  # wake myself: jobs that waited for a worker like me
    reap_now()  # at start: jobs of a worker that died while we were down
    interval = r.settings.reaper_interval_seconds
    threading.Thread(target=_tick_forever, args=(runner.shutting_down, interval), daemon=True).start()


@worker_shutting_down.connect
def _on_shutdown(**_: Any) -> None:
    # Running jobs checkpoint, stop and go back to the queue instead of blocking shutdown for hours.
    runner.shutting_down.set()
    if _in_fleet.is_set():
        r = _runner()
        with session_scope(r.sessions) as s:
            workers_db.mark_stopped(s, r.me)
