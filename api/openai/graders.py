"""/v1/fine_tuning/alpha/graders: OpenAI's `validate` and `run` over graders, per tenant, nothing stored.

validate answers "would a fine-tuning job with this grader be admitted here": the grader JSON checked whole
(400 naming the field, e.g. `grader.graders.b.type`), a python grader only where the operator enabled the
sandbox (python_grader_disabled) and it isolates (python_grader_unavailable), a score_model or
label_model grader only with a judge endpoint configured (grader_model_not_configured), a model on the
operator's list (grader_model_not_allowed) and within its token bound (grader_model_tokens_over_limit),
the same refusals as job admission; the judge acts for the calling tenant (graders.judge). The answer
echoes the normalised grader (defaults filled in; multi's `graders` a named map, or the one grader object
when that is how it was given: the openai SDK's types know only that form).

run grades one model_sample (the model's output text; sample.output_json when it is a JSON object) against
one item, as a training step grades a rollout: a failing sample is a 0 reward with metadata.errors set,
never an HTTP error. Grading blocks (a sandboxed child, judge requests), so the route is a sync def that
runs in the threadpool, and at most FTUNE_GRADER_RUN_MAX_CONCURRENT_PER_TENANT runs of a tenant (and
FTUNE_GRADER_RUN_MAX_CONCURRENT in all) grade at once in a process (429 past it). The hold lasts as long
as the grading, even when the client goes away, so disconnecting frees no slot early. Sizes are bounded
before grading: the body (1 MiB, api/bodylimit.py), the python source (256 kB), model_sample and item
(64 KiB each), and the text the grader's templates and literals make for this sample (256 KiB), since a
template that repeats {{ sample.output_text }} would otherwise multiply it and every metric's time grows
with it (none quadratically: rouge_l's LCS is bit-parallel, graders.metrics).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from api.auth import PrincipalDep
from api.deps import ServicesDep
from api.openai.errors import AUTHED, OpenAIErrorResponse, OpenAIRoute, documented
from core.errors import InvalidInput
from core.judge_config import JudgeConfig
from core.settings import Settings
from graders import (
    GradeContext,
    Grader,
    GraderError,
    grade,
    make_sample,
    templates,
)
from graders.judge import BoundedJudge, connect
from graders.multi import MultiGrader
from graders.policy import admitted
from graders.results import GradeFailure
from graders.sandbox import SandboxLimits, SandboxRunner
from graders.templates import Template

router = APIRouter(
    prefix="/fine_tuning/alpha/graders",
    tags=["openai: graders"],
    route_class=OpenAIRoute,
    responses=documented(*AUTHED)
    | {
        429: {
            "model": OpenAIErrorResponse,
            "description": "Too many grader runs of this organization at once",
        }
    },
)

MAX_SAMPLE_CHARS = 64 * 1024
MAX_ITEM_BYTES = 64 * 1024  # as compact JSON
MAX_RENDERED_CHARS = templates.MAX_RENDERED_CHARS  # all the grader's strings, filled in for this sample


class ValidateGraderRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    grader: Any = Field(description="A grader object, as for a reinforcement fine-tuning job")


class RunGraderRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    grader: Any = Field(description="A grader object, as for a reinforcement fine-tuning job")
    model_sample: str = Field(max_length=MAX_SAMPLE_CHARS, description="The model's output text")
    item: dict[str, Any] | None = Field(default=None, description="The dataset item (`item` namespace)")


class GraderValidateResponse(BaseModel):
    grader: dict[str, Any]


class GraderRunMetadata(BaseModel):
    name: str
    type: str
    errors: dict[str, bool | str | None]
    execution_time: float
    scores: dict[str, Any]
    token_usage: int | None
    sampled_model_name: str | None


class GraderRunResponse(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    reward: float
    metadata: GraderRunMetadata
    sub_rewards: dict[str, Any]
    model_grader_token_usage_per_model: dict[str, Any]


def checked(raw: Any, settings: Settings) -> Grader:
    """The grader as this server would admit it for a job (graders.policy)."""
    return admitted(
        raw,
        python_enabled=settings.python_grader_enabled,
        judge=JudgeConfig.from_settings(settings),
    )


def echoed(grader: Grader, raw: Any) -> dict[str, Any]:
    """The normalised grader in the form it was given: a multi grader given one grader object (the form the
    openai SDK's types declare) gets it back as one object, so the SDK reads the answer into its types."""
    out = grader.to_json()
    given = raw.get("graders") if isinstance(raw, dict) else None
    if isinstance(grader, MultiGrader) and isinstance(given, dict) and isinstance(given.get("type"), str):
        out["graders"] = next(iter(out["graders"].values()))
    return out


def rendered_chars(value: Any, sample: dict[str, Any], item: dict[str, Any], key: str = "") -> int:
    """How much text the grader's strings make for this sample, templates filled in (an upper bound:
    every string counts; python's source is the sandbox's business)."""
    if isinstance(value, dict):
        return sum(rendered_chars(v, sample, item, str(k)) for k, v in value.items())
    if isinstance(value, list):
        return sum(rendered_chars(v, sample, item, key) for v in value)
    if not isinstance(value, str) or key == "source":
        return 0
    if "{{" not in value:
        return len(value)
    try:
        return len(Template.parse(value, key).render(sample, item))
    except GradeFailure as e:
        if e.errors.other_error:  # one template alone fills in past the cap (graders.templates)
            return MAX_RENDERED_CHARS + 1
        return len(value)  # a variable that grading will flag
    except GraderError:  # not a template here
        return len(value)


def check_sizes(body: RunGraderRequest, sample: dict[str, Any], item: dict[str, Any]) -> None:
    if len(json.dumps(item, separators=(",", ":"))) > MAX_ITEM_BYTES:
        raise InvalidInput(
            f"item is over {MAX_ITEM_BYTES} bytes as JSON", code="invalid_request", param="item"
        )
    total = rendered_chars(body.grader, sample, item)
    if total > MAX_RENDERED_CHARS:
        raise InvalidInput(
            f"the grader's text for this sample, templates filled in, is over {MAX_RENDERED_CHARS} "
            "characters",
            code="grader_input_too_large",
            param="grader",
        )


def judge(settings: Settings, tenant_id: str) -> BoundedJudge | None:
    """The judge where one is configured, within the operator's bounds and acting for the tenant
    (graders.judge; close() it when done)."""
    config = JudgeConfig.from_settings(settings)
    return None if config is None else connect(config, tenant_id)


@router.post("/validate", response_model=GraderValidateResponse)
def validate_grader(
    body: ValidateGraderRequest, services: ServicesDep, principal: PrincipalDep
) -> JSONResponse:
    """`client.fine_tuning.alpha.graders.validate(grader=...)`: {"grader": the normalised grader}. Checked
    under the tenant's hold, as a run is: checking a grader is bounded work, but it is the tenant's."""
    with services.grader_runs.hold(principal.tenant_id):
        return JSONResponse({"grader": echoed(checked(body.grader, services.settings), body.grader)})


@router.post("/run", response_model=GraderRunResponse)
def run_grader(body: RunGraderRequest, services: ServicesDep, principal: PrincipalDep) -> JSONResponse:
    """`client.fine_tuning.alpha.graders.run(grader=..., model_sample=..., item=...)`: OpenAI's
    GraderRunResponse. A sync def: FastAPI runs it in the threadpool, off the event loop."""
    settings = services.settings
    with services.grader_runs.hold(principal.tenant_id):  # before any work of the tenant's: parsing too
        grader = checked(body.grader, settings)
        sample, item = make_sample(body.model_sample), body.item or {}
        check_sizes(body, sample, item)
        sandbox = (
            SandboxRunner(SandboxLimits.from_settings(settings)) if settings.python_grader_enabled else None
        )
        chat = judge(settings, principal.tenant_id)
        try:
            result = grade(grader, sample, item, GradeContext(chat=chat, python=sandbox))
        finally:
            if chat is not None:
                chat.close()
    return JSONResponse(result.to_run_response())
