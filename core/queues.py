"""The broker contract between the API and the workers: task and queue names, the Celery settings both
sides use, and how a wake-up call is published. Pure: the caller passes its Celery app's send_task.

The database is the source of truth; a message is a wake-up call carrying a job id. Messages are
acknowledged only after the task returns (acks_late), one at a time (prefetch 1), and the broker's
visibility timeout exceeds the longest job so it does not redeliver a job that is still training.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
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

# Placement. Every training worker consumes QUEUE and the queue of its device class. A wake-up for a job
# goes to QUEUE; the idle worker that takes it claims the next job it can run by the fair policy
# (models.fairshare), and when the message's own job does not fit it, passes the wake-up on to the class
# queues of the live workers that do fit it (worker.dispatch). So a message never decides which job runs,
# and a job is only ever claimed by a worker whose devices its plan fits (checked at claim time).
CLASS_QUEUE_PREFIX = QUEUE + "."
# A trainer also consumes a queue of its own, for the wake-ups addressed to it alone: the worker that
# places a multi-node job wakes each worker it leased as a node there (worker.nodes.wake_peers). Like any
# wake-up, it carries a job id and decides nothing: the woken worker reads its lease from the database.
WORKER_QUEUE_PREFIX = QUEUE + ".worker."

log = logging.getLogger(__name__)


def device_class(devices: list[dict[str, Any]]) -> str:
    """A short stable name for a set of devices: workers with the same devices share a class queue."""
    key = json.dumps(sorted(json.dumps(d, sort_keys=True) for d in devices))
    names = sorted({str(d.get("name", "?")) for d in devices})
    slug = re.sub(r"[^a-z0-9]+", "-", f"{len(devices)}x-{'-'.join(names)}".lower()).strip("-")[:40]
    return f"{slug}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def class_queue(devices: list[dict[str, Any]]) -> str:
    return CLASS_QUEUE_PREFIX + device_class(devices)


def worker_queue(worker_id: str) -> str:
    """The queue of one worker (its id: FTUNE_WORKER_NAME, or the name it made itself)."""
    return WORKER_QUEUE_PREFIX + worker_id


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
        return self.to(QUEUE_OF[self.task], job_id)

    def to(self, queue: str, job_id: str) -> bool:
        """Publish on `queue` (a device class's queue, when a wake-up is passed on)."""
        try:
            self.send_task(
                self.task,
                args=[job_id],
                queue=queue,
                retry=True,
                retry_policy={"max_retries": 2},
            )
        except Exception:
            log.exception("could not publish %s for job %s", self.task, job_id)
            return False
        return True
