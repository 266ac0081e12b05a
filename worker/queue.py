"""Sending job wake-up calls to the broker. Used by the API (after commit) and the reaper."""

from __future__ import annotations

import logging
from typing import Protocol

from celery import Celery

log = logging.getLogger(__name__)


class Enqueuer(Protocol):
    def __call__(self, job_id: str) -> bool: ...


class CeleryEnqueuer:
    def __init__(self, app: Celery) -> None:
        self.app = app

    def __call__(self, job_id: str) -> bool:
        """Publish the job's message. False if the broker is unreachable: the reaper re-sends later."""
        from worker.celery_app import RUN_JOB

        try:
            self.app.send_task(RUN_JOB, args=[job_id], retry=True, retry_policy={"max_retries": 2})
        except Exception:
            log.exception("could not publish job %s; the reaper will re-send it", job_id)
            return False
        return True
