"""JobSpec: the one typed contract that goes API -> database JSON -> run.json -> training.

A flat JSON object a curl user can write by hand. Every field but the first two has a default;
unknown fields are refused and every problem is reported at once (pydantic collects them).

Each field is declared here once: its group (core.spec_groups: `Annotated[int, LORA]`), default, bounds
and description. The views (spec.lora, spec.rl, ...), the JSON schema of the OpenAPI document and
docs/job_spec.md (`python -m core.spec_doc > docs/job_spec.md`) come from that declaration; the
dashboard's new-job form is checked against it (tests/api/test_dashboard_defaults.py).

Bounds are what a sane LoRA/QLoRA job can use, so a typo (lr 2, rank 100000) is a 422 and not a
worker busy for days or a planner asked about absurd sizes; no NaN or infinity anywhere (they are not
JSON either). Before/after samples: at most MAX_SAMPLE_PROMPTS prompts of at most MAX_SAMPLE_CHARS
characters (MAX_SAMPLE_MESSAGES messages).

Code reads the fields of one idea through its group: spec.lora, spec.optim, spec.data, spec.batch,
spec.preference, spec.rl, spec.samples, spec.placement, typed views that hold the checks across fields
and the values derived from them (the effective batch, whether a reference policy runs, ...).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from functools import cache
from operator import attrgetter
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from core.spec_groups import (
    BATCH,
    DATA,
    GROUPS,
    LORA,
    MAX_SAMPLE_CHARS,
    MAX_SAMPLE_MESSAGES,
    MAX_SAMPLE_PROMPTS,
    MODULE_NAME_RE,
    OPTIM,
    PLACEMENT,
    PREFERENCE,
    RL,
    RUN,
    SAMPLE_ROLES,
    SAMPLES,
    AttnImpl,
    BatchArgs,
    DataArgs,
    Group,
    GrpoDefault,
    ImportanceLevel,
    LoraArgs,
    LossType,
    Method,
    MixedPrecision,
    Objective,
    OptimArgs,
    Optimizer,
    OverLength,
    PlacementArgs,
    PreferenceArgs,
    RLArgs,
    SampleArgs,
    SampleMessage,
    SamplePrompt,
    ScaleRewards,
    Scheduler,
    TorchDtype,
    V,
)

__all__ = [
    "DPO_FIELDS",
    "GROUPS",
    "ID_RE",
    "MAX_SAMPLE_CHARS",
    "MAX_SAMPLE_MESSAGES",
    "MAX_SAMPLE_PROMPTS",
    "MODEL_NAME_RE",
    "MODULE_NAME_RE",
    "SAMPLE_ROLES",
    "AttnImpl",
    "BatchArgs",
    "DataArgs",
    "JobSpec",
    "LoraArgs",
    "LossType",
    "Method",
    "MixedPrecision",
    "Objective",
    "OptimArgs",
    "Optimizer",
    "OverLength",
    "PlacementArgs",
    "PreferenceArgs",
    "RLArgs",
    "SampleArgs",
    "SampleMessage",
    "SamplePrompt",
    "Scheduler",
    "TorchDtype",
    "group_defaults",
    "group_of",
    "limits",
]

# Base model names: a local directory name or a hub-style "org/name" id. Never a path.
MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
ID_RE = re.compile(r"^[a-z0-9]{8,64}$")


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    base_model: Annotated[str, RUN] = Field(description="Name of a local base model (see GET /models).")
    dataset_id: Annotated[str, DATA] = Field(description="Id of an uploaded, valid dataset.")

    method: Annotated[Method, LORA] = Field(
        "lora", description="lora, qlora (4-bit NF4 base) or full (planned only, not trained)."
    )
    lora_r: Annotated[int, LORA] = Field(
        16,
        ge=1,
        le=512,
        description="The adapter's rank; past 512 an adapter costs about what the full fine-tune does.",
    )
    lora_alpha: Annotated[float, LORA] = Field(
        32,
        gt=0,
        le=2048,
        description="The adapter's scale: its product is multiplied by lora_alpha / lora_r.",
    )
    lora_dropout: Annotated[float, LORA] = Field(
        0.05, ge=0, lt=0.9, description="Dropout on the adapter's input while training."
    )
    lora_target_modules: Annotated[
        Annotated[list[str], Field(max_length=64)] | Literal["all-linear"], LORA
    ] = Field(
        "all-linear",
        description="Names of the modules to adapt, or all-linear: the blocks' linear layers (not the "
        "output head, not a mixture's experts).",
    )

    epochs: Annotated[int, RUN] = Field(1, ge=1, le=100, description="Passes over the training data.")
    max_steps: Annotated[int | None, RUN] = Field(
        None, ge=1, le=1_000_000, description="Overrides epochs when set."
    )
    micro_batch_size: Annotated[int, BATCH] = Field(
        4, ge=1, le=512, description="Rows in one forward and backward pass on one GPU."
    )
    gradient_accumulation_steps: Annotated[int, BATCH] = Field(
        1, ge=1, le=1024, description="Micro-batches each GPU accumulates into one optimizer step."
    )
    examples_per_step: Annotated[int | None, BATCH] = Field(
        None,
        ge=1,
        le=512 * 1024,
        description="Examples (dpo: pairs; grpo: prompts) in every optimizer step, however packing fills "
        "rows: a step's examples are packed, cut into micro-batches of micro_batch_size rows and dealt to "
        "the GPUs, as many micro-batches as they fill (gradient_accumulation_steps then forms no step). "
        "null: a step is micro_batch_size x gradient_accumulation_steps x num_gpus rows (packed: rows of "
        "many examples). /v1's batch_size sets it.",
    )
    max_seq_len: Annotated[int, DATA] = Field(
        512,
        ge=8,
        le=131_072,
        description="Tokens of a sequence at most (each side of a dpo pair; grpo: prompt and completion).",
    )
    over_length: Annotated[OverLength, DATA] = Field(
        "truncate", description="Examples longer than max_seq_len: truncate them, or drop them."
    )
    train_on_inputs: Annotated[bool, DATA] = Field(
        False,
        description="Train on the inputs too (system and user turns, instruction, prompt, template markup); "
        "false: only on replies and completions. Assistant turns with weight 0 are never trained.",
    )
    packing: Annotated[bool, BATCH] = Field(
        True,
        description="Pack examples into padding-free micro-batches of up to micro_batch_size * max_seq_len "
        "tokens, attention per example; false: padded, length-grouped micro-batches of micro_batch_size.",
    )

    # Preference tuning (docs/training.md): the objective, its loss and its reference.
    objective: Annotated[Objective, PREFERENCE] = Field(
        "sft",
        description="sft: next-token loss on the targets; dpo: preference pairs (a preference dataset); "
        "grpo: reinforcement fine-tuning on prompts (a reinforcement dataset) scored by `grader`.",
    )
    beta: Annotated[float, PREFERENCE, GrpoDefault(0.0)] = Field(
        0.1,
        ge=0,
        le=100,
        description="dpo: how far from the reference (sigmoid, simpo), IPO's tau (ipo); > 0. grpo: the "
        "weight of the KL term to the reference (default 0: none).",
    )
    loss_type: Annotated[LossType, PREFERENCE, GrpoDefault("dapo")] = Field(
        "sigmoid",
        description="dpo: sigmoid (the DPO paper), ipo, or simpo (reference-free, length-normalised). grpo: "
        "grpo, bnpo, dr_grpo or dapo (the default), as TRL's GRPOTrainer names them.",
    )
    simpo_gamma: Annotated[float, PREFERENCE] = Field(
        0.5, ge=0, le=100, description="simpo: the target reward margin gamma."
    )
    rpo_alpha: Annotated[float, PREFERENCE] = Field(
        0.0,
        ge=0,
        le=100,
        description="dpo: weight of an added NLL term on the chosen completions (RPO).",
    )
    # Reinforcement fine-tuning (docs/training.md): objective grpo's rollouts and clipping.
    grader: Annotated[dict[str, Any] | None, RL] = Field(
        None,
        description="grpo: OpenAI's grader JSON (string_check, text_similarity, python, score_model, multi) "
        "that scores each sampled completion against its dataset row.",
    )
    num_generations: Annotated[int, RL] = Field(
        4, ge=2, le=64, description="grpo: completions sampled per prompt (a group)."
    )
    temperature: Annotated[float, RL] = Field(
        1.0, gt=0, le=2, description="grpo: the sampling temperature of rollouts."
    )
    rollout_batch_size: Annotated[int | None, RL] = Field(
        None,
        ge=1,
        le=4096,
        description="grpo: prompts sampled together in one generate() call, each with its num_generations "
        "answers; null: all of a step's prompts (micro_batch_size x gradient_accumulation_steps), as TRL "
        "samples a step's batch at once. Smaller: less KV cache, more decoding steps.",
    )
    max_completion_tokens: Annotated[int, RL] = Field(
        64, ge=1, le=8192, description="grpo: new tokens per sampled completion at most."
    )
    response_format: Annotated[dict[str, Any] | None, RL] = Field(
        None,
        description="grpo: OpenAI's response_format (json_object, or json_schema with its schema): every "
        "sampled completion is held to it by constrained decoding; null: free text.",
    )
    epsilon: Annotated[float, RL] = Field(
        0.2, gt=0, le=1, description="grpo: the ratio's lower clip, 1 - epsilon."
    )
    epsilon_high: Annotated[float | None, RL] = Field(
        None, gt=0, le=10, description="grpo: the ratio's upper clip, 1 + epsilon_high (default epsilon)."
    )
    scale_rewards: Annotated[ScaleRewards, RL] = Field(
        "group",
        description="grpo: advantages divided by the std of the group's rewards, the batch's, or none.",
    )
    importance_sampling_level: Annotated[ImportanceLevel, RL] = Field(
        "token", description="grpo: importance ratios per token, or per sequence (GSPO)."
    )
    eval_samples: Annotated[int | None, RL] = Field(
        None, ge=1, le=100_000, description="grpo: validation prompts graded at each evaluation (all: null)."
    )
    init_from: Annotated[str | None, LORA] = Field(
        None,
        description="Continue from the adapter of an earlier succeeded job of the same tenant and base "
        "model (its id); with dpo that adapter, frozen, is also the reference policy.",
    )
    init_from_step: Annotated[int | None, LORA] = Field(
        None,
        ge=1,
        le=1_000_000,
        description="With init_from: continue from that job's checkpoint at this step (a kept one) "
        "instead of its final adapter.",
    )

    learning_rate: Annotated[float, OPTIM] = Field(
        2e-4,
        gt=0,
        le=0.1,
        description="The peak learning rate; AdamW diverges well below 0.1, LoRA mostly uses 1e-5 to 1e-3.",
    )
    lr_scheduler: Annotated[Scheduler, OPTIM] = Field(
        "linear", description="After warmup: constant, or linear or half-cosine decay to 0 at the last step."
    )
    warmup_steps: Annotated[int, OPTIM] = Field(
        0, ge=0, le=100_000, description="Optimizer steps of linear warmup to the learning rate."
    )
    warmup_ratio: Annotated[float | None, OPTIM] = Field(
        None, ge=0, lt=1, description="Warmup as a fraction of the total steps; overrides warmup_steps."
    )
    weight_decay: Annotated[float, OPTIM] = Field(
        0.0, ge=0, le=1, description="AdamW's decoupled weight decay."
    )
    max_grad_norm: Annotated[float | None, OPTIM] = Field(
        1.0, gt=0, le=1000, description="Clip gradients to this norm; null: off."
    )
    optimizer: Annotated[Optimizer, OPTIM] = Field(
        "adamw", description="adamw (torch's), or bitsandbytes' adamw_8bit or paged_adamw_8bit."
    )
    seed: Annotated[int, RUN] = Field(
        42,
        ge=0,
        le=2**32 - 1,
        description="Seeds the data order, the validation split, dropout and sampling.",
    )

    # Evaluation on a held-out split: a fraction of the training file, or a second uploaded dataset.
    validation_fraction: Annotated[float, DATA] = Field(
        0.0, ge=0, le=0.5, description="Hold out this share for eval."
    )
    validation_dataset_id: Annotated[str | None, DATA] = Field(
        None, description="A valid dataset to evaluate on."
    )
    eval_every_steps: Annotated[int, DATA] = Field(
        0, ge=0, le=1_000_000, description="0: evaluate at each epoch end and at the end."
    )
    early_stopping_patience: Annotated[int | None, DATA] = Field(
        None, ge=1, le=1000, description="Stop after this many evaluations without a better eval loss."
    )
    early_stopping_min_delta: Annotated[float, DATA] = Field(
        0.0, ge=0, le=1000, description="Smallest eval-loss drop that counts."
    )
    export: Annotated[Literal["adapter", "merged"], RUN] = Field(
        "adapter", description="merged: also export the base model with the adapter merged in."
    )

    # Before/after samples (docs/training.md): greedy completions of the base (adapter disabled) and of
    # the tuned model. Off by default: sampling adds generation time to every job and its KV cache is not
    # in the plan, so a job pays for it only when asked.
    sample_prompts: Annotated[int | list[SamplePrompt], SAMPLES] = Field(
        0,
        description="N (0-32): up to N prompts from the validation split (without one, the training "
        "file's first examples); or a list of up to 32 prompts, each a string or a list of chat messages "
        "ending with a user turn. 0: no samples.",
    )
    sample_max_tokens: Annotated[int, SAMPLES] = Field(
        64, ge=1, le=512, description="New tokens per sample completion."
    )
    sample_at_eval: Annotated[bool, SAMPLES] = Field(
        False, description="Also sample at each evaluation (needs validation); false: at the end only."
    )

    gradient_checkpointing: Annotated[bool | None, PLACEMENT] = Field(
        None,
        description="Recompute activations in the backward pass (less memory, more time); null: on for "
        "qlora, off otherwise.",
    )
    checkpoint_every_steps: Annotated[int, RUN] = Field(
        50, ge=0, le=1_000_000, description="0: only at the end."
    )
    keep_checkpoints: Annotated[int, RUN] = Field(
        3,
        ge=1,
        le=100,
        description="Checkpoints kept on disk: the newest N, plus the best by eval loss. They count in the "
        "tenant's storage quota.",
    )

    torch_dtype: Annotated[TorchDtype, PLACEMENT] = Field(
        "auto", description="Storage dtype of unquantized base weights."
    )
    mixed_precision: Annotated[MixedPrecision, PLACEMENT] = Field(
        "auto", description="auto: bf16 on a GPU, off on a CPU."
    )
    master_weights: Annotated[bool, PLACEMENT] = Field(
        False, description="Keep fp32 master copies (full fine-tune)."
    )
    attn_implementation: Annotated[AttnImpl, PLACEMENT] = Field(
        "sdpa", description="The attention kernel: torch's sdpa, eager, or flash_attention_2."
    )
    num_gpus: Annotated[int, PLACEMENT] = Field(
        1, ge=1, le=256, description="GPUs the job runs on per node; over one, FSDP2 shards it across them."
    )
    num_nodes: Annotated[int, PLACEMENT] = Field(
        1,
        ge=1,
        le=64,
        description="Workers (machines) the job runs on at once, each with num_gpus devices: FSDP2 shards it "
        "over num_nodes x num_gpus ranks under torchrun's c10d rendezvous (docs/scaling.md).",
    )
    priority: Annotated[int, RUN] = Field(
        0, ge=-100, le=100, description="Order among this tenant's own queued jobs: higher first, then FIFO."
    )

    # Checks of one field (loc: the field), then the checks across fields (loc: the spec), each the
    # check of its group (core.spec_groups), in this order: a spec with several problems reports the first.

    @field_validator("base_model")
    @classmethod
    def _model_name(cls, v: str) -> str:
        if not MODEL_NAME_RE.match(v) or ".." in v:
            raise ValueError("must be a model name like 'ftune-demo' or 'org/name', not a path")
        return v

    @field_validator("dataset_id")
    @classmethod
    def _dataset_id(cls, v: str) -> str:
        if not ID_RE.match(v):
            raise ValueError("must be a dataset id returned by POST /datasets")
        return v

    @field_validator("validation_dataset_id")
    @classmethod
    def _validation_dataset_id(cls, v: str | None) -> str | None:
        if v is not None and not ID_RE.match(v):
            raise ValueError("must be a dataset id returned by POST /datasets")
        return v

    @field_validator("init_from")
    @classmethod
    def _init_from(cls, v: str | None) -> str | None:
        if v is not None and not ID_RE.match(v):
            raise ValueError("must be the id of an earlier job (GET /jobs)")
        return v

    @field_validator("lora_target_modules")
    @classmethod
    def _modules(cls, v: list[str] | str) -> list[str] | str:
        return LoraArgs.check_target_modules(v)

    @field_validator("sample_prompts", mode="before")
    @classmethod
    def _sample_prompts(cls, v: Any) -> Any:
        return SampleArgs.check_prompts(v)

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """Checked now, the schema compiled as rollouts will compile it (core.response_format)."""
        if v is None or v.get("type") == "text":
            return None
        from core.response_format import ResponseFormatError, check_response_format

        try:
            check_response_format(v)
        except ResponseFormatError as e:
            raise ValueError(f"{e.field}: {e}") from None
        return v

    @field_validator("grader", mode="before")
    @classmethod
    def _grader(cls, v: Any) -> dict[str, Any] | None:
        """The whole grader tree checked now (a bad one is a 4xx naming its field, not a failed job);
        whether python graders may run is the service's policy, checked at admission. Before pydantic's
        own validation, which would copy a 1 MiB grader whole before parse_grader bounds its size."""
        if v is None:
            return v
        from graders import parse_grader

        return parse_grader(v, allow_python=True).to_json()

    @model_validator(mode="before")
    @classmethod
    def _method_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("gradient_checkpointing") is None:
            data = {**data, "gradient_checkpointing": PlacementArgs.default_checkpointing(data.get("method"))}
        if isinstance(data, dict) and data.get("objective") == "grpo":  # grpo's own defaults
            data = {**{k: v for k, v in GRPO_DEFAULTS.items() if data.get(k) is None}, **data}
        return data

    @model_validator(mode="after")
    def _groups(self) -> JobSpec:
        self.lora.check()
        self.samples.check(has_validation=self.data.has_validation)
        self.preference.check(train_on_inputs=self.train_on_inputs, defaults=group_defaults(PREFERENCE))
        self.rl.check(defaults=group_defaults(RL))
        self.data.check()
        return self

    # The groups (core.spec_groups): read-only views of the fields above, built on each access; what a
    # view holds beyond its group's fields and others' by name is derived here.

    def _view(self, group: Group[V], **derived: Any) -> V:
        assert group.view is not None
        names, read = _view_sources(group)
        return group.view(**{**dict(zip(names, read(self), strict=True)), **derived})  # derived wins

    @property
    def lora(self) -> LoraArgs:
        return self._view(LORA)

    @property
    def optim(self) -> OptimArgs:
        return self._view(OPTIM)

    @property
    def data(self) -> DataArgs:
        return self._view(DATA)

    @property
    def batch(self) -> BatchArgs:
        packing = self.packing and self.objective != "grpo"  # grpo: a row is a prompt (RLArgs)
        ranks = self.num_gpus * self.num_nodes  # a step is split over every rank of every node
        return self._view(
            BATCH, packing=packing, sequences_per_example=self.sequences_per_example, num_gpus=ranks
        )

    @property
    def preference(self) -> PreferenceArgs:
        return self._view(PREFERENCE)

    @property
    def rl(self) -> RLArgs:
        return self._view(RL, step_prompts=self.batch.step_size)

    @property
    def samples(self) -> SampleArgs:
        return self._view(SAMPLES)

    @property
    def placement(self) -> PlacementArgs:
        return self._view(PLACEMENT, gradient_checkpointing=bool(self.gradient_checkpointing))

    # Shorthands for the edges (the API, the database layer), each one of a group's values.

    @property
    def uses_reference(self) -> bool:
        """DPO's sigmoid and ipo losses compare with a reference policy (PreferenceArgs.uses_reference)."""
        return self.preference.uses_reference

    @property
    def sequences_per_example(self) -> int:
        """Sequences an example becomes: a preference pair two, a grpo prompt its group of completions."""
        if self.objective == "grpo":
            return self.num_generations
        return 2 if self.objective == "dpo" else 1

    @property
    def has_validation(self) -> bool:
        return self.data.has_validation

    def warmup_steps_for(self, total_steps: int) -> int:
        return self.optim.warmup_steps_for(total_steps)

    @property
    def effective_batch_size(self) -> int:
        return self.batch.effective_size


def group_of(name: str) -> Group[Any]:
    """The group a JobSpec field is declared in."""
    (group,) = (m for m in JobSpec.model_fields[name].metadata if isinstance(m, Group))
    return group


@cache
def group_defaults(group: Group[Any]) -> Mapping[str, Any]:
    """The group's own fields at their defaults, by their names in its view, in declaration order: the
    values the checks of objectives that do not use them compare with."""
    return MappingProxyType(
        {
            name.removeprefix(group.prefix): f.default
            for name, f in JobSpec.model_fields.items()
            if group_of(name) == group
        }
    )


@cache
def _view_sources(group: Group[Any]) -> tuple[tuple[str, ...], Callable[[JobSpec], tuple[Any, ...]]]:
    """The view fields read as is, and a reader of their values: the group's own fields less its prefix,
    and another group's field under its own name. The rest (derived) the view's property passes."""
    assert group.view is not None
    own = {flat.removeprefix(group.prefix): flat for flat in JobSpec.model_fields if group_of(flat) == group}
    names = [f.name for f in dataclasses.fields(group.view)]
    pairs = [(n, own.get(n, n)) for n in names if n in own or n in JobSpec.model_fields]
    assert len(pairs) > 1  # attrgetter of one name returns the value, not a tuple
    return tuple(n for n, _ in pairs), attrgetter(*(flat for _, flat in pairs))


def limits(name: str) -> dict[str, Any]:
    """A field's numeric bounds as Field keywords (ge, gt, le, lt), for a surface that renames the field."""
    out: dict[str, Any] = {}
    for m in JobSpec.model_fields[name].metadata:
        out |= {k: getattr(m, k) for k in ("ge", "gt", "le", "lt") if getattr(m, k, None) is not None}
    return out


# grpo's own defaults where they differ (GrpoDefault on the declaration).
GRPO_DEFAULTS = {
    name: m.value
    for name, f in JobSpec.model_fields.items()
    for m in f.metadata
    if isinstance(m, GrpoDefault)
}
# The preference fields other than the objective: dpo's (beta and loss_type grpo's too).
DPO_FIELDS = tuple(f for f in group_defaults(PREFERENCE) if f != "objective")
