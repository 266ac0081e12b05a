"""The Celery application. Configuration only: importing this must stay cheap (no torch).

The database is the source of truth; a message is a wake-up call carrying a job id. Messages are
acknowledged only after the task returns (acks_late), one at a time (prefetch 1), and the broker's
visibility timeout exceeds the longest job so it does not redeliver a job that is still training.
"""

from __future__ import annotations

from celery import Celery

from core.settings import Settings, get_settings

RUN_JOB = "ftune.run_job"
REAP = "ftune.reap"
QUEUE = "ftune-jobs"


def create_celery(settings: Settings) -> Celery:
    app = Celery("ftune", broker=settings.redis_url or None)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=QUEUE,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": settings.visibility_timeout_seconds},
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        enable_utc=True,
    )
    return app


app = create_celery(get_settings())
