"""The API's side of the broker: a Celery app used only to publish wake-up calls (core.queues)."""

from __future__ import annotations

from celery import Celery

from core.queues import Enqueuer, celery_config
from core.settings import Settings


def broker_enqueuer(settings: Settings) -> Enqueuer:
    """Connects lazily, on the first publish: building it has no side effect."""
    app = Celery("ftune-api")
    app.conf.update(celery_config(settings))
    return Enqueuer(app.send_task)
