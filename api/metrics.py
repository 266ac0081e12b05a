"""Prometheus metrics: the service's state read from the database at scrape time, and API latency.

The database is the source of truth, so job and worker numbers are computed when scraped (the same on
every API replica); only request latency is counted in this process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.catalog import Catalog
from models import stats
from models import workers as workers_db
from models.placement import Placer
from models.queue_view import QueueEntry, queue_view
from models.tables import utcnow

# Seconds; fine-tuning jobs run from a minute to days.
JOB_BUCKETS = (60.0, 300.0, 900.0, 1800.0, 3600.0, 3 * 3600.0, 6 * 3600.0, 12 * 3600.0, 24 * 3600.0)


class ServiceCollector(Collector):
    def __init__(self, sessions: sessionmaker[Session], catalog: Catalog | None = None) -> None:
        self.sessions = sessions
        # to place queued jobs on the fleet (queue position, waiting reasons), cached across scrapes
        self.placer = Placer(catalog) if catalog is not None else None

    def collect(self) -> Iterator[Metric]:
        with self.sessions() as s:
            counts = stats.counts_by_status(s)
            durations = stats.finished_durations(s, JOB_BUCKETS)
            throughput = stats.running_throughput(s)
            now = utcnow()
            workers = [(w, workers_db.is_alive(w, now)) for w in workers_db.list_workers(s)]
            queue = queue_view(s, self.placer, now) if self.placer is not None else {}

        jobs = GaugeMetricFamily("ftune_jobs", "Jobs by status", labels=["status"])
        for status, n in counts.items():
            jobs.add_metric([status], n)
        yield jobs
        yield GaugeMetricFamily("ftune_queue_depth", "Jobs waiting for a worker", value=counts["queued"])
        yield _duration_histogram(durations)
        if self.placer is not None:
            yield from _queue_gauges(queue, now)

        per_job = GaugeMetricFamily(
            "ftune_job_tokens_per_second", "Training throughput of a running job", labels=["job_id", "worker"]
        )
        for job_id, worker, tps in throughput:
            per_job.add_metric([job_id, worker], tps)
        yield per_job
        total = sum(tps for _, _, tps in throughput)
        yield GaugeMetricFamily("ftune_training_tokens_per_second", "Sum over running jobs", value=total)

        up = GaugeMetricFamily("ftune_worker_up", "1 if the worker's heartbeat is recent", labels=["worker"])
        age = GaugeMetricFamily(
            "ftune_worker_heartbeat_age_seconds", "Seconds since the last heartbeat", labels=["worker"]
        )
        for w, alive in workers:
            up.add_metric([w.id], 1.0 if alive else 0.0)
            age.add_metric([w.id], (now - w.heartbeat_at).total_seconds())
        yield up
        yield age
        fleet = GaugeMetricFamily("ftune_workers", "Workers seen, alive or lost", labels=["state"])
        fleet.add_metric(["alive"], sum(1 for _, alive in workers if alive))
        fleet.add_metric(["lost"], sum(1 for _, alive in workers if not alive))
        yield fleet


def _queue_gauges(queue: dict[str, QueueEntry], now: datetime) -> Iterator[Metric]:
    """Per queued job (bounded by the per-tenant active-job limit): position and seconds to its start."""
    waiting = [e for e in queue.values() if e.position is None]  # not a multi-node job short of room
    yield GaugeMetricFamily(
        "ftune_queue_waiting_for_worker", "Queued jobs no live worker can run", value=len(waiting)
    )
    position = GaugeMetricFamily(
        "ftune_queue_position", "A queued job's place on the workers that can run it", labels=["job_id"]
    )
    start = GaugeMetricFamily(
        "ftune_queue_estimated_start_seconds",
        "Seconds until a queued job is expected to start",
        labels=["job_id"],
    )
    for job_id, e in sorted(queue.items()):
        if e.position is not None:
            position.add_metric([job_id], e.position)
        if e.estimated_start is not None:
            start.add_metric([job_id], max(0.0, (e.estimated_start - now).total_seconds()))
    yield position
    yield start


def _duration_histogram(durations: dict[str, stats.Durations]) -> HistogramMetricFamily:
    h = HistogramMetricFamily(
        "ftune_job_duration_seconds", "Run time of finished jobs (last start to finish)", labels=["status"]
    )
    for status, d in sorted(durations.items()):
        buckets = [(str(b), float(n)) for b, n in zip(JOB_BUCKETS, d.le, strict=True)]
        buckets.append(("+Inf", float(d.jobs)))
        h.add_metric([status], buckets, sum_value=d.total_seconds)
    return h


def new_registry(
    sessions: sessionmaker[Session], catalog: Catalog | None = None
) -> tuple[CollectorRegistry, Histogram]:
    """One registry per app (not the global one), so several apps in one process do not collide."""
    registry = CollectorRegistry()
    registry.register(ServiceCollector(sessions, catalog))
    latency = Histogram(
        "ftune_http_request_duration_seconds",
        "API request latency by route template",
        ["method", "route", "status"],
        registry=registry,
    )
    return registry, latency


class LatencyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which would buffer server-sent event streams)."""

    def __init__(self, app: ASGIApp, latency: Histogram) -> None:
        self.app = app
        self.latency = latency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.latency.labels(scope["method"], _route(scope), str(status)).observe(
                time.perf_counter() - start
            )


def _route(scope: MutableMapping[str, Any]) -> str:
    # The template ("/jobs/{job_id}"), never the raw path: ids would make one series per job.
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"
