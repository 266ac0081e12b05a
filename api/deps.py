"""Dependencies as Annotated aliases. Everything a route needs comes from app.state.services."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from api.ratelimit import RateLimiter
from core.catalog import Catalog
from core.settings import Settings
from core.storage import Storage
from models.placement import Placer
from models.tenants import Principal


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
    # Queued jobs planned on the fleet's devices, cached across requests (queue position, waiting reasons).
    placer: Placer = field(init=False)

    def __post_init__(self) -> None:
        self.placer = Placer(self.catalog)


def get_services(request: Request) -> Services:
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]


def get_session(services: ServicesDep) -> Iterator[Session]:
    with services.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
