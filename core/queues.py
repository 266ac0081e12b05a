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
TOKEN_STATS = "ftune.token_stats"
QUEUE = "ftune-jobs"  # training: served by the workers of a device class, one job at a time each
# Short CPU work (token statistics): its own queue and worker process, so it never waits behind a
# training job that holds a jobs worker for hours.
CPU_QUEUE = "ftune-cpu"
QUEUE_OF = {RUN_JOB: QUEUE, REAP: QUEUE, TOKEN_STATS: CPU_QUEUE}

log = logging.getLogger(__name__)


def celery_config(settings: Settings) -> dict[str, Any]:
    return {
        "broker_url": settings.redis_url or None,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_default_queue": QUEUE,
        "task_routes": {name: {"queue": queue} for name, queue in QUEUE_OF.items()},
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
    """Publishes a job's message for `task` (a wake-up call carrying the job id) with a Celery app's
    `send_task`. Returns False when the broker is unreachable: the job is committed, and a lost run_job
    is re-sent by the reaper (lost token statistics are filled from training's start record)."""

    def __init__(self, send_task: Callable[..., Any], task: str = RUN_JOB) -> None:
        self.send_task = send_task
        self.task = task

    def __call__(self, job_id: str) -> bool:
        try:
            self.send_task(
                self.task,
                args=[job_id],
                queue=QUEUE_OF[self.task],
                retry=True,
                retry_policy={"max_retries": 2},
            )
        except Exception:
            log.exception("could not publish %s for job %s", self.task, job_id)
            return False
        return True
