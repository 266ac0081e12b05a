"""Admission of a job spec: references exist (datasets of the kind the objective trains, the job it
continues from), the method is runnable here, and it fits the fleet."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from core.arch import load_architecture
from core.catalog import Catalog
from core.data.examples import KIND_OBJECTIVE, kind_of
from core.errors import Conflict, InvalidInput, NotFound, Unsupported
from core.judge_config import JudgeConfig
from core.settings import Settings
from core.spec import JobSpec
from core.states import JobStatus
from graders.policy import admitted
from models import datasets as datasets_db
from models import jobs as jobs_db
from models import openai_jobs
from models import workers as workers_db
from models.job_inputs import base_model, datasets_with
from models.tables import Dataset, Job
from models.vision_admission import check_image_base
from planner import BatchShape, Plan
from planner.feasibility import plan_for_fleet, plan_on, require_fits, tokens_per_epoch
from planner.gpus import resolve_gpu
from planner.sharding import fsdp_problem

log = logging.getLogger(__name__)


# What each objective trains, for the message; and the code of a dataset of another kind (stable codes).
DATASETS_FOR = {
    "sft": "chat, instruction, prompt_completion or text examples",
    "dpo": "preference pairs: formats preference, chosen_rejected",
    "grpo": "prompts: messages ending in a user turn, format reinforcement",
}
WRONG_KIND_CODE = {"dpo": "dataset_not_preference", "grpo": "dataset_not_prompts"}


def check_grader_policy(spec: JobSpec, settings: Settings) -> None:
    """What this server grades with (graders.policy, core.settings.Settings): python graders only
    where the operator enabled the sandbox and it isolates them, model graders only with a judge endpoint
    configured and within the operator's bounds on it (its allowed models, its tokens per call)."""
    if spec.grader is not None:
        admitted(
            spec.grader,
            python_enabled=settings.python_grader_enabled,
            judge=JudgeConfig.from_settings(settings),
        )


def check_dataset(
    session: Session,
    *,
    dataset_id: str,
    tenant_id: str,
    param: str = "dataset_id",
    objective: str | None = None,
) -> Dataset:
    """The caller's own valid dataset (even an admin trains only on its own tenant's data), of the kind
    `objective` trains (when given): preference pairs for dpo, examples for sft."""
    ds = datasets_db.get_dataset(session, dataset_id, tenant_id)
    if ds is None:
        raise InvalidInput(
            f"dataset {dataset_id!r} does not exist; upload one with POST /datasets",
            code="dataset_not_found",
            param=param,
        )
    if ds.status == datasets_db.DELETED:
        raise InvalidInput(
            f"dataset {dataset_id!r} was deleted and cannot be trained on; upload it again",
            code="dataset_deleted",
            param=param,
        )
    if ds.status != "valid":
        raise InvalidInput(
            f"dataset {dataset_id!r} is invalid and cannot be trained on; see GET /datasets/{ds.id}",
            code="dataset_invalid",
            param=param,
        )
    kind = kind_of(ds.format)
    if objective is not None and kind is not None and KIND_OBJECTIVE[kind] != objective:
        raise InvalidInput(
            f"objective {objective!r} does not train dataset {dataset_id!r}: it holds {ds.format!r} rows, "
            f"which objective {KIND_OBJECTIVE[kind]!r} trains ({DATASETS_FOR[objective]} for {objective!r})",
            code=WRONG_KIND_CODE.get(objective, f"dataset_is_{kind}"),
            param=param,
        )
    return ds


def recheck_references(session: Session, *, spec: JobSpec, tenant_id: str) -> None:
    """In the job's insert transaction, after models.tenants.lock_tenant (which the deletes of datasets
    take too): what admission checked is still there. A dataset deleted (or a job deleted) while the job
    was admitted is a Conflict, not a foreign key's error."""
    named = (("dataset_id", spec.dataset_id), ("validation_dataset_id", spec.validation_dataset_id))
    for param, dataset_id in named:
        if dataset_id and datasets_db.get_live_dataset(session, dataset_id, tenant_id) is None:
            raise Conflict(
                f"dataset {dataset_id!r} was deleted while the job was admitted; upload it again and "
                "resubmit the job",
                code="dataset_deleted_during_admission",
                param=param,
            )
    if spec.init_from is not None:
        earlier = jobs_db.get_job(session, spec.init_from, tenant_id)
        if earlier is None or earlier.deleted_at is not None:
            raise Conflict(
                f"job {spec.init_from!r} was deleted while the job was admitted; init_from names an "
                "earlier job of yours that still has its adapter",
                code="init_from_deleted_during_admission",
                param="init_from",
            )


def check_tools_template(
    *, catalog: Catalog, spec: JobSpec, datasets: list[Dataset], check: ToolsCheck
) -> None:
    """Data that define or call tools train only on a base model whose chat template renders them
    (models.tool_support): else the model would learn calls to tools it was never shown."""
    with_tools = datasets_with(datasets, "with_tools")
    if not with_tools:
        return
    model = base_model(catalog, spec)
    problem = check(model.path)
    if problem:
        ds = with_tools[0]
        count = ds.report["stats"]["with_tools"]
        raise InvalidInput(
            f"base model {spec.base_model!r} cannot train on dataset {ds.id!r}: {count} of its examples "
            f"define or call tools, and the model's chat template {problem}; choose a base model whose chat "
            "template renders tools (Qwen2.5 and Llama 3.1 instruct models, for example)",
            code="template_cannot_render_tools",
            param="base_model",
            details={"base_model": spec.base_model, "dataset_id": ds.id, "problem": problem},
        )


# The fields that shape a LoRA adapter: a job continuing from one must ask for the same shape.
LORA_SHAPE = ("lora_r", "lora_alpha", "lora_target_modules")


def check_init_from(session: Session, *, spec: JobSpec, tenant_id: str) -> Job | None:
    """spec.init_from: an earlier job of the same tenant that succeeded (so its adapter exists), on the
    same base model, whose adapter has the shape this spec asks for. None when the spec has none."""
    if spec.init_from is None:
        return None
    earlier = jobs_db.get_job(session, spec.init_from, tenant_id)
    if earlier is None:  # another tenant's job is missing too
        raise InvalidInput(
            f"job {spec.init_from!r} does not exist; init_from names an earlier job of yours",
            code="init_from_not_found",
            param="init_from",
        )
    if earlier.deleted_at is not None:  # its adapter and checkpoints are gone
        raise InvalidInput(
            f"job {spec.init_from!r} was deleted with its adapter; init_from names an earlier job of yours "
            "that still has one",
            code="init_from_deleted",
            param="init_from",
        )
    if earlier.status != JobStatus.SUCCEEDED:
        raise InvalidInput(
            f"job {spec.init_from!r} is {earlier.status}; only a succeeded job has an adapter to "
            "continue from",
            code="init_from_not_succeeded",
            param="init_from",
            details={"status": earlier.status},
        )
    if earlier.base_model != spec.base_model:
        raise InvalidInput(
            f"job {spec.init_from!r} trained an adapter for base model {earlier.base_model!r}, not "
            f"{spec.base_model!r}; continue on its base model",
            code="init_from_base_mismatch",
            param="base_model",
            details={"base_model": earlier.base_model},
        )
    different = {
        f: earlier.spec.get(f) for f in LORA_SHAPE if earlier.spec.get(f) != spec.model_dump(mode="json")[f]
    }
    if different:
        raise InvalidInput(
            f"job {spec.init_from!r} trained an adapter of another shape: set "
            + ", ".join(f"{k}={v!r}" for k, v in different.items())
            + " to continue from it",
            code="init_from_lora_mismatch",
            param=next(iter(different)),
            details=different,
        )
    step = spec.init_from_step
    if step is not None and openai_jobs.checkpoint(session, earlier.id, step) is None:
        raise InvalidInput(
            f"job {spec.init_from!r} saved no checkpoint at step {step}; list its checkpoints with "
            f"GET /v1/fine_tuning/jobs/{spec.init_from}/checkpoints",
            code="checkpoint_not_found",
            param="init_from_step",
        )
    return earlier


# A base model's directory -> what its chat template does wrong with tools, or None (models.tool_support).
ToolsCheck = Callable[[Path], str | None]
PlanFor = Callable[[BatchShape | None], Plan | None]  # a job's plan for a micro-batch shape (None: worst)


def planner(
    session: Session,
    *,
    catalog: Catalog,
    spec: JobSpec,
    gpu: str | None,
    tenant_id: str,
    plan_gpu: str = "",
) -> PlanFor:
    """The job's planning function, its inputs read once (the model's architecture, the data's report,
    the fleet): on a named GPU, else on the fleet, else on `plan_gpu` (settings.plan_gpu); it answers
    None when there is nothing to plan on. Its argument is the data's largest micro-batch (token
    statistics), or None for the worst case."""
    try:
        model = catalog.get(spec.base_model)
    except NotFound as e:
        raise InvalidInput(e.message, code="model_not_found", param="base_model") from e
    arch = load_architecture(model.path)
    ds = datasets_db.get_dataset(session, spec.dataset_id, tenant_id)
    report: dict[str, Any] = ds.report if ds is not None else {}
    tokens = tokens_per_epoch(report, spec.max_seq_len)
    fleet = [] if gpu else [w.devices for w in workers_db.fleet(session)]
    if fleet:
        return lambda shape: plan_for_fleet(spec, arch, fleet, tokens, shape=shape)
    device = gpu or plan_gpu
    if device:
        return lambda shape: plan_on(spec, arch, resolve_gpu(device), tokens, shape=shape)
    return lambda shape: None


def make_plan(
    session: Session,
    *,
    catalog: Catalog,
    spec: JobSpec,
    gpu: str | None,
    tenant_id: str,
    plan_gpu: str = "",
    shape: BatchShape | None = None,
) -> Plan | None:
    """One plan (see planner): for `shape`, the data's largest micro-batch, else the worst case."""
    plan_for = planner(session, catalog=catalog, spec=spec, gpu=gpu, tenant_id=tenant_id, plan_gpu=plan_gpu)
    return plan_for(shape)


# A job's token statistics measured now (models.token_stats: {"status": "ready", ...} or failed(...)).
Measure = Callable[[JobSpec], dict[str, Any]]
# The smallest micro-batch there is: if even it does not fit, no data's lengths can make the job fit.
SMALLEST = BatchShape(tokens=1, seq_len=1, targets=1)


@dataclass(frozen=True)
class Admitted:
    plan: Plan | None  # the plan the job was admitted on; None: nothing to plan on (admitted unplanned)
    token_stats: dict[str, Any] | None = None  # measured at admission, when the data's lengths decided


def admit(
    session: Session,
    *,
    catalog: Catalog,
    spec: JobSpec,
    tenant_id: str,
    plan_gpu: str = "",
    measure: Measure | None = None,
    tools_check: ToolsCheck | None = None,
) -> Admitted:
    """Raise a clear error for a job that cannot run; return the plan it was admitted on.
    A job whose worst case (every micro-batch micro_batch_size x max_seq_len tokens) does not fit is
    planned again from its data's lengths, measured now with `measure`, unless even the smallest
    micro-batch would not fit: a max_seq_len far above the data's longest example costs nothing.
    `tools_check`: whether the base model's template renders tools, asked for data with tools."""
    datasets = [
        check_dataset(session, dataset_id=spec.dataset_id, tenant_id=tenant_id, objective=spec.objective)
    ]
    if spec.validation_dataset_id:
        validation = check_dataset(
            session,
            dataset_id=spec.validation_dataset_id,
            tenant_id=tenant_id,
            param="validation_dataset_id",
            objective=spec.objective,
        )
        datasets.append(validation)
    check_init_from(session, spec=spec, tenant_id=tenant_id)
    check_image_base(catalog=catalog, spec=spec, datasets=datasets)
    if tools_check is not None:
        check_tools_template(catalog=catalog, spec=spec, datasets=datasets, check=tools_check)
    plan_for = planner(session, catalog=catalog, spec=spec, gpu=None, tenant_id=tenant_id, plan_gpu=plan_gpu)
    plan = plan_for(None)
    if spec.method == "full":
        raise Unsupported(
            "method 'full' can be planned (POST /plan) but this service trains LoRA and QLoRA adapters only",
            param="method",
        )
    problem = fsdp_problem(spec)
    if problem:
        raise Unsupported(problem[1], code="unsupported_with_fsdp", param=problem[0])
    if plan is None:
        log.warning("no worker has registered its devices and FTUNE_PLAN_GPU is unset: admitting unplanned")
        return Admitted(None)
    if plan.fits or measure is None:
        return Admitted(require_fits(plan))
    smallest = plan_for(SMALLEST)
    if smallest is None or not smallest.fits:
        require_fits(plan, "; not even one token per sequence would fit")
    stats = measure(spec)
    shape = BatchShape.from_token_stats(stats)
    if shape is None:
        reason = (stats.get("error") or {}).get("message", "no answer")
        require_fits(plan, f"; the data's lengths could not be measured: {reason}")
    on_data = plan_for(shape)
    assert on_data is not None  # the same devices as the worst case's
    return Admitted(require_fits(on_data), stats)
