"""create_app(): the FastAPI application with its services wired from settings.

Run it with `ftune api` (uvicorn --factory api.main:create_app). Building the app has no side effect:
it touches no file, database or broker; startup work (data directories, the bootstrap admin key) runs
in the lifespan, and the engine is disposed on shutdown.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from api import errors, openai
from api.bodylimit import LARGE_BODY_BYTES, MAX_JSON_BODY_BYTES, BodySizeLimit, LargeBodyGate
from api.deps import Services
from api.metrics import LatencyMiddleware, new_registry
from api.routes import (
    checkpoints,
    dashboard,
    datasets,
    health,
    jobs,
    live,
    metrics,
    models,
    plan,
    webhooks,
    workers,
)
from core.secretbox import SecretBox
from core.settings import Settings, get_settings
from graders import sandbox
from models import webhooks as webhooks_db
from models.db import session_scope
from models.tenants import Principal, ensure_key, get_or_create_tenant

log = logging.getLogger(__name__)


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


def startup(services: Services) -> None:
    services.storage.ensure()
    services.local_principal = provision_auth(services.settings, services.sessions)
    box = functools.cache(lambda: SecretBox.from_settings(services.settings))
    with session_scope(services.sessions) as s:
        if sealed := webhooks_db.seal_plain_secrets(s, box):
            log.info("sealed %d webhook secrets stored in plain text before secrets were sealed", sealed)
    if not services.settings.redis_url:
        log.warning("FTUNE_REDIS_URL is not set: jobs are stored but no worker will be woken")
    if services.settings.python_grader_enabled:  # probed now, so the log says at start what graders get
        why = sandbox.why_unavailable()
        if why:
            log.warning("python graders are enabled but refused here (python_grader_unavailable): %s", why)
        else:
            log.info("python graders: the sandbox isolates them (namespaces proven by its probe)")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    services: Services = app.state.services
    await run_in_threadpool(startup, services)
    try:
        yield
    finally:
        services.engine.dispose()


def create_app(
    settings: Settings | None = None,
    enqueue: Callable[[str], bool] | None = None,
    token_stats: Callable[[str], bool] | None = None,
) -> FastAPI:
    """`enqueue` (wake a worker for a job) and `token_stats` (ask for a job's token statistics) are
    injectable; by default both publish to the broker (core.queues)."""
    services = Services.from_settings(settings or get_settings(), enqueue, token_stats)
    app = FastAPI(
        title="ftune",
        version="0.1.0",
        description="Self-hosted LoRA/QLoRA fine-tuning: upload JSONL, submit jobs, download adapters.",
        lifespan=lifespan,
    )
    app.state.services = services
    errors.install(app)
    app.state.metrics_registry, latency = new_registry(services.sessions, services.catalog)
    app.add_middleware(LatencyMiddleware, latency=latency)
    routers = (
        health,
        datasets,
        jobs,
        checkpoints,
        live,
        plan,
        models,
        workers,
        webhooks,
        dashboard,
        metrics,
        openai,
    )
    for module in routers:
        app.include_router(module.router)
    uploads = {("POST", "/datasets"), ("POST", "/v1/files")}  # streamed to disk under their own limits
    app.add_middleware(LargeBodyGate, exempt=uploads, threshold=LARGE_BODY_BYTES, per_credential=1, total=4)
    app.add_middleware(BodySizeLimit, max_bytes=MAX_JSON_BODY_BYTES, exempt=uploads)
    return app
