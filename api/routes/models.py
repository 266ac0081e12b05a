"""Base models available on this server (local only; `ftune models pull` is how an operator adds one)."""

from __future__ import annotations

from fastapi import APIRouter

from api.auth import PrincipalDep
from api.deps import ServicesDep
from api.responses import AUTHED, errors
from api.schemas import ModelOut

router = APIRouter(prefix="/models", tags=["models"], responses=errors(*AUTHED))


@router.get("", response_model=list[ModelOut])
def list_models(services: ServicesDep, _: PrincipalDep) -> list[ModelOut]:
    return [
        ModelOut(
            name=m.name,
            source=m.source,
            architecture=m.architecture,
            model_type=m.model_type,
            revision=m.revision,
        )
        for m in services.catalog.list()
    ]
