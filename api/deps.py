"""Dependencies as Annotated aliases. Everything a route needs comes from app.state.services (Services,
built from settings by create_app, and by the CLI for its submission)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from api.chat_queue import FairChatQueue
from api.pulls import HubPulls
from api.queue import broker_publishers, redis_ping
from api.ratelimit import RateLimiter
from api.watch import JobWatch
from core.catalog import Catalog
from core.settings import Settings
from core.spec import JobSpec
from core.storage import Storage
from models import jobs as jobs_db
from models.db import make_engine, make_session_factory, session_scope
from models.fleet_limits import FleetCounters
from models.placement import Placer
from models.submission import OpenAIFields, submit_job
from models.tables import Job
from models.tenants import Principal, TenantGate
from models.token_stats import measurement_gate


@dataclass
class Services:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    storage: Storage
    catalog: Catalog
    enqueue: Callable[[str], bool]  # wakes a worker for a job (ftune.run_job)
    request_token_stats: Callable[[str], bool]  # asks a CPU worker for a job's token statistics
    broker_ping: Callable[[], bool]
    rate_limiter: RateLimiter
    local_principal: Principal | None = None  # set at startup (lifespan) when auth is off
    # The broker's counts: each tenant's bounds below and its request rate hold across every API process.
    fleet: FleetCounters | None = None
    # Queued jobs planned on the fleet's devices, cached across requests (queue position, waiting reasons).
    placer: Placer = field(init=False)
    # Bounds on work at once (429 past them), per tenant across the fleet (with a broker), in all per process.
    measurements: TenantGate = field(init=False)
    uploads: TenantGate = field(init=False)
    chats: FairChatQueue = field(init=False)  # the engine is shared: tenants' chat completions take turns
    grader_runs: TenantGate = field(init=False)  # /v1 graders/run: sandbox children, judge requests
    pulls: HubPulls = field(init=False)  # POST /models/pull: this process's Hub pulls and their progress
    # Event streams (api/sse.py): a tenant's open at once, counted in this process (each holds one of its
    # connections and tasks), and the one poller of the jobs they follow.
    streams: TenantGate = field(init=False)
    watch: JobWatch = field(init=False)

    def __post_init__(self) -> None:
        self.placer = Placer(self.catalog)
        self.pulls = HubPulls(self.settings.models_dir, max_file_bytes=self.settings.hub_max_file_bytes)
        self.measurements = measurement_gate(self.settings, self.fleet)
        self.uploads = TenantGate(
            what="uploads",
            code="too_many_uploads",
            per_tenant=self.settings.max_concurrent_uploads_per_tenant,
            fleet=self.fleet,
        )
        self.chats = FairChatQueue(
            running=self.settings.chat_max_running,
            shared=self.settings.chat_max_running_shared,
            queued_per_tenant=self.settings.chat_max_queued_per_tenant,
            linger_seconds=self.settings.chat_share_linger_seconds,
            fleet=self.fleet,
        )
        self.grader_runs = TenantGate(
            what="grader runs",
            code="too_many_concurrent_requests",
            per_tenant=self.settings.grader_run_max_concurrent_per_tenant,
            total=self.settings.grader_run_max_concurrent,
            fleet=self.fleet,
            retry_after=1,
        )
        # A slot frees when a stream ends; a stream whose client went is noticed at its next write at the
        # latest (a keep-alive), so after that long the tenant's slots are its live streams.
        self.streams = TenantGate(
            what="event streams",
            code="too_many_streams",
            per_tenant=self.settings.sse_max_streams_per_tenant,
            retry_after=math.ceil(self.settings.sse_keepalive_seconds),
        )
        self.watch = JobWatch(self.sessions, self.settings.sse_poll_seconds)

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        enqueue: Callable[[str], bool] | None = None,
        token_stats: Callable[[str], bool] | None = None,
    ) -> Services:
        """The services wired from settings; both publishers default to the broker (core.queues). Building
        them has no side effect: the engine connects on first use, the broker on the first publish."""
        engine = make_engine(settings.resolved_database_url)
        fleet = FleetCounters(settings.redis_url) if settings.redis_url else None
        if enqueue is None or token_stats is None:
            run_job, stats = broker_publishers(settings)
            enqueue, token_stats = enqueue or run_job, token_stats or stats
        return cls(
            settings=settings,
            engine=engine,
            sessions=make_session_factory(engine),
            storage=Storage(settings.data_dir),
            catalog=Catalog(settings.models_dir, settings.hf_cache_dir),
            enqueue=enqueue,
            request_token_stats=token_stats,
            broker_ping=redis_ping(settings.redis_url),
            rate_limiter=RateLimiter(settings.rate_limit_per_minute, fleet),
            fleet=fleet,
        )

    def delete_finished_job(self, job_id: str) -> bool:
        """Mark a finished job deleted (its record and events stay) and remove its files: checkpoints,
        adapter, merged weights, metrics, logs. False when it has not finished: nothing is done. The files
        go after the commit: a crash leaves files, never rows that name missing files."""
        with session_scope(self.sessions) as s:
            deleted = jobs_db.mark_deleted(s, job_id=job_id)
        if deleted:
            self.storage.delete_job_files(job_id)
        return deleted

    def submit(self, spec: JobSpec, *, tenant_id: str, openai: OpenAIFields | None = None) -> Job:
        """models.submission.submit_job on these services: POST /jobs, /v1 and `ftune jobs submit` alike."""
        return submit_job(
            self.sessions,
            settings=self.settings,
            catalog=self.catalog,
            storage=self.storage,
            spec=spec,
            tenant_id=tenant_id,
            enqueue=self.enqueue,
            request_token_stats=self.request_token_stats,
            openai=openai,
            measurements=self.measurements,
        )


def get_services(request: Request) -> Services:
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]


def get_session(services: ServicesDep) -> Iterator[Session]:
    with services.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
