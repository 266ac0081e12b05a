"""OpenAI's create-job request, mapped onto ftune's JobSpec (translation only; admission is models').

What `"auto"` picks, and what each number means:
- `n_epochs`: JobSpec `epochs`; auto = JobSpec's default (1).
- `learning_rate_multiplier`: multiplies ftune's default learning rate (JobSpec `learning_rate`, 2e-4);
  auto = 1.
- `batch_size`: examples per optimizer step, over all GPUs (JobSpec `examples_per_step`: with packing a
  step's examples are packed into as many rows as they fill); auto = OpenAI's documented rule, ~0.2% of
  the training file's examples, at most 256 (`auto_batch_size`: round half up, at least 1, then up to a
  multiple of num_gpus); reinforcement's auto = JobSpec's default step (4 prompts per GPU). The batch
  per GPU sets micro_batch_size x gradient_accumulation_steps: the planner's largest micro-batch that
  fits (a divisor of the batch per GPU) times its accumulation (see models/auto_batch.py); with packing
  a step runs as many of those micro-batches as its rows fill, at most that many.
ftune's own settings ride along as extra body fields under their JobSpec names; what JobSpec calls
`method` is `adapter` here. A setting given twice (`n_epochs` and `epochs`) is refused, naming it.

`method.type` "reinforcement" (objective grpo; docs/training.md): `grader` is JobSpec's
`grader`; `batch_size` counts prompts per step; `eval_interval` is eval_every_steps (auto: at each epoch
end and at the end) and, as on OpenAI, checkpoint_every_steps unless that is given too; `eval_samples`
the validation prompts graded per evaluation (auto: all);
`compute_multiplier` scales the completions sampled per prompt, num_generations = round(4 x it), 2..64
(auto: 1, four); `reasoning_effort` is accepted and echoed but has no effect: no base model ftune trains
reasons with a budget; `response_format` (json_object / json_schema) is JobSpec's `response_format`:
every rollout is sampled under its grammar (constrained decoding), so a sample's output_json parses
unless max_completion_tokens cut it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core.errors import InvalidInput, Unsupported
from core.spec import JobSpec, limits
from graders.parse import check_size

Auto = Literal["auto"]
DEFAULT_LR: float = JobSpec.model_fields["learning_rate"].default
DEFAULT_EPOCHS: int = JobSpec.model_fields["epochs"].default
DEFAULT_MICRO: int = JobSpec.model_fields["micro_batch_size"].default
DEFAULT_ACCUM: int = JobSpec.model_fields["gradient_accumulation_steps"].default

# JobSpec fields an OpenAI field already sets: as an extra field it is the same setting given twice.
SET_BY_OPENAI = {
    "base_model": "model",
    "dataset_id": "training_file",
    "validation_dataset_id": "validation_file",
    "method": "adapter",  # JobSpec's method (lora|qlora) is `adapter` here; `method` is OpenAI's
}
# JobSpec fields a hyperparameter sets.
SET_BY_HYPERPARAMETER = {
    "epochs": "n_epochs",
    "learning_rate": "learning_rate_multiplier",
    "micro_batch_size": "batch_size",
    "gradient_accumulation_steps": "batch_size",
    "examples_per_step": "batch_size",
}
# batch_size "auto" (OpenAI's fine-tuning guide): ~0.2% of the training examples (1 in 500), at most 256.
AUTO_BATCH_PER = 500
AUTO_BATCH_MAX = 256
AUTO_BATCH_KEY = "auto_batch_size"  # in a job's stored request: {"training_examples": n} auto chose from
# OpenAI's names on errors that admission reports under JobSpec's.
OPENAI_PARAM = SET_BY_OPENAI


class Hyperparameters(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    # Bounds on the numbers only: "auto" is not compared with them. Each the JobSpec field's it sets.
    n_epochs: Annotated[int, Field(**limits("epochs"))] | Auto = "auto"
    batch_size: Annotated[int, Field(**limits("examples_per_step"))] | Auto = "auto"
    learning_rate_multiplier: (
        Annotated[float, Field(gt=0, le=limits("learning_rate")["le"] / DEFAULT_LR)] | Auto
    ) = "auto"


class DpoHyperparameters(Hyperparameters):
    beta: Annotated[float, Field(gt=0, le=limits("beta")["le"])] | Auto = "auto"  # dpo's beta is > 0


class ReinforcementHyperparameters(Hyperparameters):
    eval_interval: Annotated[int, Field(ge=1, le=limits("eval_every_steps")["le"])] | Auto = "auto"
    eval_samples: Annotated[int, Field(**limits("eval_samples"))] | Auto = "auto"
    compute_multiplier: Annotated[float, Field(gt=0, le=16)] | Auto = "auto"
    reasoning_effort: Literal["auto", "default", "low", "medium", "high"] = "auto"


class Reinforcement(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grader: dict[str, Any]
    hyperparameters: ReinforcementHyperparameters = ReinforcementHyperparameters()
    response_format: dict[str, Any] | None = None

    @field_validator("grader", mode="before")
    @classmethod
    def _bounded(cls, v: Any) -> Any:
        """Bounded before pydantic copies it whole (JobSpec parses it when the job is mapped)."""
        check_size(v, "method.reinforcement.grader")
        return v


class Supervised(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hyperparameters: Hyperparameters = Hyperparameters()


class Dpo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hyperparameters: DpoHyperparameters = DpoHyperparameters()


class Method(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: Supervised | None = None
    dpo: Dpo | None = None
    reinforcement: Reinforcement | None = None

    @model_validator(mode="after")
    def _matching_type(self) -> Method:
        other = {"supervised", "dpo", "reinforcement"} - {self.type}
        given = [name for name in sorted(other) if getattr(self, name) is not None]
        if given:
            raise ValueError(f"method.{given[0]} is set but method.type is {self.type!r}")
        if self.type == "reinforcement" and self.reinforcement is None:
            raise ValueError("method.type 'reinforcement' needs method.reinforcement with its grader")
        return self


class CreateJobRequest(BaseModel):
    """The body of `client.fine_tuning.jobs.create(...)`; extra fields are ftune's JobSpec settings."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str = Field(max_length=300)
    training_file: str = Field(max_length=200)
    validation_file: str | None = Field(None, max_length=200)
    suffix: str | None = Field(None, min_length=1, max_length=64)
    seed: Annotated[int, Field(**limits("seed"))] | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    method: Method | None = None
    hyperparameters: Hyperparameters | None = Field(None, description="Deprecated: use method.")
    integrations: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _metadata_sizes(self) -> CreateJobRequest:
        for key, value in (self.metadata or {}).items():
            if len(key) > 64 or len(value) > 512:
                raise ValueError("metadata keys are at most 64 characters and values at most 512")
        return self


@dataclass(frozen=True)
class Mapped:
    """The JobSpec fields of a request (batch split still to choose) and the hyperparameters it asked for."""

    fields: dict[str, Any]
    batch_size: int | Auto | None  # None: set by micro_batch_size / gradient_accumulation_steps fields
    method_type: MethodType
    echo: dict[str, Any] | None = None  # reinforcement: what the job object echoes beyond the spec


MethodType = Literal["supervised", "dpo", "reinforcement"]
DEFAULT_GENERATIONS: int = JobSpec.model_fields["num_generations"].default


def _hyperparameters(req: CreateJobRequest) -> tuple[Hyperparameters, MethodType]:
    if req.method is not None and req.hyperparameters is not None:
        raise InvalidInput(
            "hyperparameters given twice: set them in method only (the top-level field is deprecated)",
            code="duplicate_parameter",
            param="hyperparameters",
        )
    if req.method is None:
        return req.hyperparameters or Hyperparameters(), "supervised"
    if req.method.type == "reinforcement":
        assert req.method.reinforcement is not None  # Method's check
        return req.method.reinforcement.hyperparameters, "reinforcement"
    if req.method.type == "dpo":
        return (req.method.dpo or Dpo()).hyperparameters, "dpo"
    return (req.method.supervised or Supervised()).hyperparameters, "supervised"


def _dpo_fields(hp: Hyperparameters) -> dict[str, Any]:
    """JobSpec's DPO fields, when ftune has them; else a clear refusal."""
    if "objective" not in JobSpec.model_fields:
        raise Unsupported(
            "method.type 'dpo' is not supported by this ftune version yet; use 'supervised'",
            param="method.type",
        )
    fields: dict[str, Any] = {"objective": "dpo"}
    beta = getattr(hp, "beta", "auto")
    if beta != "auto":
        fields["beta"] = beta
    return fields


def _reinforcement_fields(req: CreateJobRequest) -> tuple[dict[str, Any], dict[str, Any]]:
    """(JobSpec's grpo fields, what the job object echoes that the spec does not hold)."""
    rf = req.method.reinforcement if req.method else None
    assert rf is not None
    hp = rf.hyperparameters
    fields: dict[str, Any] = {"objective": "grpo", "grader": rf.grader}
    if rf.response_format is not None:
        fields["response_format"] = rf.response_format
    if hp.eval_interval != "auto":
        fields["eval_every_steps"] = hp.eval_interval
        if "checkpoint_every_steps" not in (req.model_extra or {}):  # a checkpoint at each evaluation
            fields["checkpoint_every_steps"] = hp.eval_interval
    if hp.eval_samples != "auto":
        fields["eval_samples"] = hp.eval_samples
    if hp.compute_multiplier != "auto":
        fields["num_generations"] = min(64, max(2, round(DEFAULT_GENERATIONS * hp.compute_multiplier)))
    echo = {"reasoning_effort": hp.reasoning_effort, "response_format": rf.response_format}
    return fields, echo


def map_request(req: CreateJobRequest, base_model: str, init_from: str | None) -> Mapped:
    """JobSpec fields for the request (`base_model` and `init_from` as resolved from `model`)."""
    for integration in req.integrations or []:
        if integration.get("type") not in (None, "none"):
            raise Unsupported(
                f"integration {integration.get('type')!r} is not supported by ftune; leave it unset",
                param="integrations",
            )
    hp, method_type = _hyperparameters(req)
    extra = dict(req.model_extra or {})
    for name, openai_name in SET_BY_OPENAI.items():
        if name in extra and name != "method":
            raise InvalidInput(
                f"{name} given twice: as {name!r} and as {openai_name!r}; send {openai_name!r} only",
                code="duplicate_parameter",
                param=name,
            )
    given = hp.model_fields_set
    for name, hp_name in SET_BY_HYPERPARAMETER.items():
        if name in extra and hp_name in given:
            raise InvalidInput(
                f"{name} given twice: as {name!r} and as hyperparameter {hp_name!r}; send one of them",
                code="duplicate_parameter",
                param=name,
            )
    if "seed" in extra:
        raise InvalidInput("seed given twice", code="duplicate_parameter", param="seed")
    fields: dict[str, Any] = {k: v for k, v in extra.items() if k != "adapter"}
    if "adapter" in extra:
        fields["method"] = extra["adapter"]
    fields |= {"base_model": base_model, "dataset_id": req.training_file}
    if req.validation_file is not None:
        fields["validation_dataset_id"] = req.validation_file
    if init_from is not None:
        fields["init_from"] = init_from
    if req.seed is not None:
        fields["seed"] = req.seed
    if hp.n_epochs != "auto":
        fields["epochs"] = hp.n_epochs
    if hp.learning_rate_multiplier != "auto":
        fields["learning_rate"] = hp.learning_rate_multiplier * DEFAULT_LR
    echo = None
    if method_type == "dpo":
        fields |= _dpo_fields(hp)
    if method_type == "reinforcement":
        grpo, echo = _reinforcement_fields(req)
        fields |= grpo
    split_given = "micro_batch_size" in extra or "gradient_accumulation_steps" in extra
    batch = extra.get("examples_per_step", hp.batch_size)  # as an extra field: the same number
    return Mapped(fields, None if split_given else batch, method_type, echo)


def build_spec(fields: dict[str, Any]) -> JobSpec:
    """The JobSpec, or a 400 naming the first bad field by the name the caller used."""
    try:
        return JobSpec.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(p) for p in first["loc"]]
        name = loc[0] if loc else None
        param = OPENAI_PARAM.get(name, name) if name else None
        problem = "is not a setting ftune knows" if first["type"] == "extra_forbidden" else first["msg"]
        more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        raise InvalidInput(f"{param}: {problem}{more}", code="invalid_parameter", param=param) from e


def auto_batch_size(num_examples: int) -> int:
    """batch_size "auto" for a training file of `num_examples`: ~0.2% of them (rounded half up), at least
    1, at most 256. 160 examples: 1; 1,000: 2; 127,750 and more: 256."""
    return min(AUTO_BATCH_MAX, max(1, (num_examples + AUTO_BATCH_PER // 2) // AUTO_BATCH_PER))


def per_gpu_batch(batch_size: int | Auto, num_gpus: int, num_examples: int | None = None) -> int:
    """The examples per optimizer step on one GPU for a batch over all GPUs. auto: auto_batch_size of the
    training file's `num_examples`, rounded up to a multiple of num_gpus; not known (None): JobSpec's
    default (micro_batch_size x gradient_accumulation_steps)."""
    if batch_size == "auto" and num_examples is not None:
        return -(-auto_batch_size(num_examples) // num_gpus)
    if batch_size == "auto":
        return DEFAULT_MICRO * DEFAULT_ACCUM
    if batch_size % num_gpus:
        raise InvalidInput(
            f"batch_size {batch_size} does not split evenly over num_gpus {num_gpus}",
            code="invalid_parameter",
            param="batch_size",
        )
    return batch_size // num_gpus


def resolved(spec: JobSpec, method_type: str, echo: dict[str, Any] | None = None) -> dict[str, Any]:
    """The job object's `hyperparameters` and `method` for a spec: numbers, no "auto" left. `echo`: a
    reinforcement job's reasoning_effort and response_format, as asked (Mapped.echo)."""
    hp: dict[str, Any] = {
        "n_epochs": spec.epochs,
        "batch_size": spec.examples_per_step or spec.effective_batch_size,
        "learning_rate_multiplier": spec.learning_rate / DEFAULT_LR,
    }
    if method_type == "dpo":
        hp["beta"] = getattr(spec, "beta", None)
    block: dict[str, Any] = {"hyperparameters": hp}
    if method_type == "reinforcement":
        echo = echo or {}
        hp |= {
            "eval_interval": spec.eval_every_steps or "auto",
            "eval_samples": spec.eval_samples or "auto",
            "compute_multiplier": spec.num_generations / DEFAULT_GENERATIONS,
            "reasoning_effort": echo.get("reasoning_effort", "auto"),
        }
        block = {"grader": spec.grader, "hyperparameters": hp, "response_format": echo.get("response_format")}
    return {"hyperparameters": hp, "method": {"type": method_type, method_type: block}}
