"""The worker's Celery application, configured from core.queues (the contract the API shares)."""

from __future__ import annotations

from celery import Celery

from core.queues import QUEUE, REAP, RUN_JOB, celery_config
from core.settings import Settings, get_settings

__all__ = ["DELIVER_WEBHOOKS", "QUEUE", "REAP", "RUN_JOB", "app", "create_celery"]
# Sent by no one on a schedule: every worker's tick runs a delivery pass itself (worker/tasks.py); the
# task lets an operator ask for one now (`celery -A worker.tasks call ftune.deliver_webhooks`).
DELIVER_WEBHOOKS = "ftune.deliver_webhooks"


def create_celery(settings: Settings) -> Celery:
    app = Celery("ftune")
    app.conf.update(celery_config(settings))
    return app


app = create_celery(get_settings())
