"""create_app(): the FastAPI application with its services wired from settings.

Run it with `ftune api` (uvicorn --factory api.main:create_app).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import redis
from fastapi import FastAPI
from sqlalchemy.orm import Session, sessionmaker

from api import errors, openai
from api.bodylimit import MAX_JSON_BODY_BYTES, BodySizeLimit
from api.deps import Services
from api.metrics import LatencyMiddleware, new_registry
from api.queue import broker_enqueuer
from api.ratelimit import RateLimiter
from api.routes import dashboard, datasets, health, jobs, live, metrics, models, plan, workers
from api.token_stats import Compute, TokenStatsQueue, subprocess_compute
from core.catalog import Catalog
from core.settings import Settings, get_settings
from core.storage import Storage
from models.db import make_engine, make_session_factory, session_scope
from models.tenants import Principal, ensure_key, get_or_create_tenant

log = logging.getLogger(__name__)


def redis_ping(url: str) -> Callable[[], bool]:
    def ping() -> bool:
        if not url:
            return False
        try:
            client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except redis.RedisError:
            return False

    return ping


def provision_auth(settings: Settings, sessions: sessionmaker[Session]) -> Principal | None:
    """Provision the bootstrap admin key; with auth off, return the principal every request acts as."""
    with session_scope(sessions) as s:
        if settings.bootstrap_admin_key:
            ensure_key(s, settings.bootstrap_admin_key, "admin", is_admin=True)
        if settings.auth == "off":
            log.warning("AUTH IS OFF (FTUNE_AUTH=off): every request acts as the admin of tenant 'local'")
            tenant = get_or_create_tenant(s, "local")
            return Principal(tenant.id, tenant.name, is_admin=True)
    return None


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    app.state.services.token_stats.close()  # kill a running computation rather than wait for it


def create_app(
    settings: Settings | None = None,
    enqueue: Callable[[str], bool] | None = None,
    token_stats: Compute | None = None,
) -> FastAPI:
    """`enqueue` and `token_stats` (the computation) are injectable; by default the broker and the
    `python -m training.token_stats` subprocess."""
    settings = settings or get_settings()
    storage = Storage(settings.data_dir)
    storage.ensure()
    engine = make_engine(settings.resolved_database_url)
    sessions = make_session_factory(engine)
    services = Services(
        settings=settings,
        engine=engine,
        sessions=sessions,
        storage=storage,
        catalog=Catalog(settings.models_dir, settings.hf_cache_dir),
        enqueue=enqueue or broker_enqueuer(settings),
        broker_ping=redis_ping(settings.redis_url),
        rate_limiter=RateLimiter(settings.rate_limit_per_minute),
        token_stats=TokenStatsQueue(
            sessions,
            token_stats or subprocess_compute(settings.token_stats_timeout_seconds),
            settings.token_stats_max_waiting,
        ),
        local_principal=provision_auth(settings, sessions),
    )
    if not settings.redis_url:
        log.warning("FTUNE_REDIS_URL is not set: jobs are stored but no worker will be woken")
    app = FastAPI(
        title="ftune",
        version="0.1.0",
        description="Self-hosted LoRA/QLoRA fine-tuning: upload JSONL, submit jobs, download adapters.",
        lifespan=lifespan,
    )
    app.state.services = services
    errors.install(app)
    app.state.metrics_registry, latency = new_registry(sessions)
    app.add_middleware(LatencyMiddleware, latency=latency)
    for module in (health, datasets, jobs, live, plan, models, workers, dashboard, metrics, openai):
        app.include_router(module.router)
    uploads = {("POST", "/datasets"), ("POST", "/v1/files")}  # streamed to disk under their own limits
    app.add_middleware(BodySizeLimit, max_bytes=MAX_JSON_BODY_BYTES, exempt=uploads)
    return app
