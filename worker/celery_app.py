"""The worker's Celery application, configured from core.queues (the contract the API shares).

`create_celery(settings)` builds a configured app with no tasks (a publisher needs no more);
worker.tasks.create_worker_app registers the worker's tasks on one.
"""

from __future__ import annotations

from celery import Celery

from core.queues import QUEUE, REAP, RUN_JOB, TOKEN_STATS, celery_config
from core.settings import Settings

__all__ = ["DELIVER_WEBHOOKS", "QUEUE", "REAP", "RUN_JOB", "TOKEN_STATS", "create_celery"]
# Sent by no one on a schedule: every worker's tick runs a delivery pass itself (worker/tasks.py); the
# task lets an operator ask for one now (`celery -A worker.tasks call ftune.deliver_webhooks`).
DELIVER_WEBHOOKS = "ftune.deliver_webhooks"


def create_celery(settings: Settings) -> Celery:
    app = Celery("ftune")
    app.conf.update(celery_config(settings))
    return app
