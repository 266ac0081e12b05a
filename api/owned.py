"""The caller's own job, loaded by the id in the path, for both APIs: OwnedJob (native) and
OwnedFineTuningJob (/v1) as Annotated dependencies, and the one way to cancel, pause or resume it.

Another tenant's job is 404, exactly like a missing one. A dependency loads the job in the request's
session (SessionDep, shared with the route); a route that needs its own session (a transaction, or a
short read before a stream) calls the lookup's `load` in it instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal, TypeVar

from fastapi import Depends
from sqlalchemy.orm import Session

from api.auth import PrincipalDep, scope
from api.deps import Services, SessionDep
from core.errors import NotFound
from models import control
from models import jobs as jobs_db
from models.tables import Job
from models.tenants import Principal


@dataclass(frozen=True)
class JobLookup:
    """How one API finds the caller's job, and names one it cannot show (404 job_not_found)."""

    missing: str  # the message, formatted with the id's repr
    param: str  # the name of the id in this API's errors
    admin_sees_all: bool  # an admin key sees every tenant's jobs (native), or its own tenant's only (/v1)

    def load(self, session: Session, job_id: str, principal: Principal) -> Job:
        tenant = scope(principal) if self.admin_sees_all else principal.tenant_id
        job = jobs_db.get_job(session, job_id, tenant)
        if job is None:
            raise NotFound(self.missing.format(job_id), code="job_not_found", param=self.param)
        return job


NATIVE = JobLookup("job {!r} not found", param="job_id", admin_sees_all=True)
FINE_TUNING = JobLookup("no such fine-tuning job: {!r}", param="fine_tuning_job_id", admin_sees_all=False)


def _native_job(job_id: str, session: SessionDep, principal: PrincipalDep) -> Job:
    return NATIVE.load(session, job_id, principal)


def _fine_tuning_job(job_id: str, session: SessionDep, principal: PrincipalDep) -> Job:
    return FINE_TUNING.load(session, job_id, principal)


OwnedJob = Annotated[Job, Depends(_native_job)]
OwnedFineTuningJob = Annotated[Job, Depends(_fine_tuning_job)]

Action = Literal["cancel", "pause", "resume"]
ACTIONS: dict[Action, Callable[..., None]] = {
    "cancel": control.cancel,
    "pause": control.pause,
    "resume": control.resume,
}
Out = TypeVar("Out")


def control_job(
    action: Action,
    job_id: str,
    services: Services,
    principal: Principal,
    lookup: JobLookup,
    render: Callable[[Job], Out],
) -> Out:
    """The caller's job after a models.control action (its Conflict is each API's to answer), as `render`
    shows it. Short sessions of its own: the action commits in between."""
    with services.sessions() as s:
        lookup.load(s, job_id, principal)
    ACTIONS[action](services.sessions, job_id=job_id, param=lookup.param)
    with services.sessions() as s:
        out = render(lookup.load(s, job_id, principal))
    if action == "resume":  # after the commit and the read: the answer is the job as resumed, queued
        services.enqueue(job_id)  # if the broker is down the reaper re-sends it
    return out
