"""The broker contract between the API and the workers: task and queue names, the Celery settings both
sides use, and how a wake-up call is published. Pure: the caller passes its Celery app's send_task.

The database is the source of truth; a message is a wake-up call carrying a job id. Messages are
acknowledged only after the task returns (acks_late), one at a time (prefetch 1), and the broker's
visibility timeout exceeds the longest job so it does not redeliver a job that is still training.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from core.settings import Settings

RUN_JOB = "ftune.run_job"
REAP = "ftune.reap"
QUEUE = "ftune-jobs"

log = logging.getLogger(__name__)


def celery_config(settings: Settings) -> dict[str, Any]:
    return {
        "broker_url": settings.redis_url or None,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_default_queue": QUEUE,
        "task_ignore_result": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {"visibility_timeout": settings.visibility_timeout_seconds},
        "worker_hijack_root_logger": False,
        "worker_send_task_events": False,
        "enable_utc": True,
    }


class Enqueuer:
    """Publishes a job's wake-up call with a Celery app's `send_task`. Returns False when the broker is
    unreachable: the job is committed, and the reaper re-sends its message later."""

    def __init__(self, send_task: Callable[..., Any]) -> None:
        self.send_task = send_task

    def __call__(self, job_id: str) -> bool:
        try:
            self.send_task(RUN_JOB, args=[job_id], retry=True, retry_policy={"max_retries": 2})
        except Exception:
            log.exception("could not publish job %s; the reaper will re-send it", job_id)
            return False
        return True
