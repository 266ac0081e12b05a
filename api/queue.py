"""The API's side of the broker: publishers of wake-up calls (core.queues), on one Celery app that
connects lazily, on the first publish, and a ping for health: building them has no side effect."""

from __future__ import annotations

from collections.abc import Callable

import redis
from celery import Celery

from core.queues import RUN_JOB, TOKEN_STATS, Enqueuer, celery_config
from core.settings import Settings


def broker_publishers(settings: Settings) -> tuple[Enqueuer, Enqueuer]:
    """(run_job, token_stats) publishers."""
    app = Celery("ftune-api")
    app.conf.update(celery_config(settings))
    return Enqueuer(app.send_task, RUN_JOB), Enqueuer(app.send_task, TOKEN_STATS)


def redis_ping(url: str) -> Callable[[], bool]:
    def ping() -> bool:
        if not url:
            return False
        try:
            client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except redis.RedisError:
            return False

    return ping
