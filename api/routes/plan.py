"""POST /plan: the memory plan of a job spec, on a named GPU or on the fleet, without queuing anything."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import Field

from api.auth import PrincipalDep
from api.deps import ServicesDep, SessionDep
from api.jsonbody import ThreadDecodedRoute
from api.responses import AUTHED, errors
from core.errors import Unavailable
from core.spec import JobSpec
from models.admission import make_plan
from planner import Plan

router = APIRouter(tags=["plan"], responses=errors(*AUTHED), route_class=ThreadDecodedRoute)


class PlanRequest(JobSpec):
    gpu: str | None = Field(
        None, max_length=64, description="A GPU type ('A100-80GB') or size ('24GB'); default: the fleet."
    )


@router.post("/plan", response_model=Plan, responses=errors(400, 413, 503))
def plan(request: PlanRequest, session: SessionDep, services: ServicesDep, principal: PrincipalDep) -> Plan:
    """Predicted peak memory per GPU, itemised; the verdict; and, if it does not fit, changes that do."""
    spec = JobSpec.model_validate(request.model_dump(exclude={"gpu"}))
    result = make_plan(
        session,
        catalog=services.catalog,
        spec=spec,
        gpu=request.gpu,
        tenant_id=principal.tenant_id,
        plan_gpu=services.settings.plan_gpu,
    )
    if result is None:
        raise Unavailable("no worker has reported its devices yet; name a target GPU in 'gpu'", param="gpu")
    return result
