"""Base models available on this server, and pulling one from the Hub (admins; the dashboard's button).

Jobs never download: a model is on disk before a job can name it. An operator adds one with
`ftune models pull`, or here: POST /models/pull runs the same core.hub.pull in a thread of this API process
(api/pulls.py), and GET /models/pulls/{id} says how far it got.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.auth import AdminDep, PrincipalDep
from api.deps import ServicesDep
from api.pulls import Pull
from api.responses import AUTHED, errors
from api.schemas import ErrorInfo, ModelOut
from core.errors import Forbidden
from core.spec import MODEL_NAME_RE

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
            family=m.family,
            modality=m.modality,
            total_params=m.total_params,
            active_params=m.active_params,
        )
        for m in services.catalog.list()
    ]


class PullIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    repo: str = Field(
        pattern=MODEL_NAME_RE.pattern,
        description="A Hub model id, org/name; it is listed under that name once pulled.",
        examples=["Qwen/Qwen2.5-0.5B"],
    )
    revision: str | None = Field(
        None,
        min_length=1,
        max_length=255,
        pattern=r"^[A-Za-z0-9._/-]+$",
        description="A branch, tag or commit (default main); the commit it resolves to is recorded.",
    )

    @field_validator("repo")
    @classmethod
    def _no_dot_dot(cls, v: str) -> str:
        if ".." in v:
            raise ValueError("a Hub model id has no '..'")
        return v


class PullOut(BaseModel):
    id: str
    repo: str
    revision: str | None
    state: Literal["running", "succeeded", "failed"]
    stage: str = Field(description="resolving, checking (config.json), downloading, registering, done")
    current_file: str | None = Field(description="The file being downloaded now.")
    files_done: int
    files_total: int = Field(description="0 until config.json is checked and the files are known.")
    bytes_done: int
    bytes_total: int
    commit_sha: str | None
    model: str | None = Field(description="The base_model name (GET /models) once succeeded.")
    already_present: bool = Field(description="That commit was there already: nothing was downloaded.")
    error: ErrorInfo | None
    started_at: datetime
    finished_at: datetime | None


def pull_out(p: Pull) -> PullOut:
    state, progress = p.state, p.progress  # the state first: a finished pull's record is complete
    return PullOut(
        id=p.id,
        repo=p.repo,
        revision=p.revision,
        state=state,
        stage=progress.stage,
        current_file=progress.file,
        files_done=progress.files_done,
        files_total=progress.files_total,
        bytes_done=progress.bytes_done,
        bytes_total=progress.bytes_total,
        commit_sha=progress.commit_sha,
        model=p.result.name if p.result else None,
        already_present=bool(p.result and p.result.already_present),
        error=ErrorInfo(code=p.error.code, message=p.error.message) if p.error else None,
        started_at=p.started_at,
        finished_at=p.finished_at,
    )


@router.post("/pull", response_model=PullOut, status_code=202, responses=errors(400, 403, 409, 413))
def start_pull(body: PullIn, services: ServicesDep, _: AdminDep) -> PullOut:
    """Start pulling a base model from the Hub (HF_ENDPOINT, HF_TOKEN) into the models directory: checked
    as `ftune models pull` checks it (architecture, no custom code, safetensors only). Poll its progress
    at GET /models/pulls/{id}. 409 while the same repo is being pulled; 403 when FTUNE_HUB_PULL_ENABLED
    is off. Progress lives in this API process."""
    if not services.settings.hub_pull_enabled:
        raise Forbidden(
            "pulling models from the Hub is turned off on this server (FTUNE_HUB_PULL_ENABLED=false); "
            "an operator can run `ftune models pull` or copy the model into the models directory",
            code="hub_pull_disabled",
        )
    return pull_out(services.pulls.start(body.repo, body.revision))


@router.get("/pulls", response_model=list[PullOut], responses=errors(403))
def list_pulls(services: ServicesDep, _: AdminDep) -> list[PullOut]:
    """This API process's pulls, newest first (the running ones and the last finished ones)."""
    return [pull_out(p) for p in services.pulls.list()]


@router.get("/pulls/{pull_id}", response_model=PullOut, responses=errors(403, 404))
def get_pull(pull_id: str, services: ServicesDep, _: AdminDep) -> PullOut:
    return pull_out(services.pulls.get(pull_id))
