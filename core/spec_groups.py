"""JobSpec's fields in groups: typed read-only views of the flat spec, with their checks and derived values.

The wire format stays one flat object (core.spec.JobSpec: what a curl user writes, what the database and
run.json hold); code that reads several fields of one idea reads that idea's view instead, as litgpt's
TrainArgs and EvalArgs group a training script's arguments:

  spec.lora        LoraArgs: method, the adapter's shape, what it starts from (init_from, init_from_step)
  spec.optim       OptimArgs: optimizer, learning rate and its schedule, weight decay, gradient clipping
  spec.data        DataArgs: the dataset, what is held out to evaluate on, how examples are rendered
  spec.batch       BatchArgs: what one optimizer step trains (micro-batch, accumulation, ranks, rows)
  spec.preference  PreferenceArgs: the objective (sft, dpo or grpo), its loss and whether a reference runs
  spec.rl          RLArgs: reinforcement fine-tuning (grpo): the grader, rollouts, GRPO's clipping
  spec.samples     SampleArgs: before/after sample prompts
  spec.placement   PlacementArgs: devices, precision, attention, activation checkpointing

Each field is declared once, on JobSpec, with its group (`Annotated[int, LORA]`, the groups at the end of
this module), default, bounds and description; docs/job_spec.md is generated from that declaration
(core.spec_doc). A view is built from the spec's fields on each access (a frozen dataclass; the spec stays
the one store): a view field is its group's field less the group's prefix (LORA's `lora_r` is `r`), or a
field of another group under its own name (borrowed: BatchArgs' max_seq_len), or a value JobSpec derives.
A view's fields restate only the types, for the type checker; tests/core/test_spec_declaration.py fails
when they drift from the declaration. The checks that read more than one field live here, and JobSpec's
validators call them in a fixed order, so a spec with several problems reports the same first one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

MODULE_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,63}$")

Method = Literal["lora", "qlora", "full"]
Optimizer = Literal["adamw", "adamw_8bit", "paged_adamw_8bit"]
Scheduler = Literal["constant", "linear", "cosine"]
TorchDtype = Literal["auto", "float32", "bfloat16", "float16"]
MixedPrecision = Literal["auto", "no", "bf16", "fp16"]
AttnImpl = Literal["sdpa", "eager", "flash_attention_2"]
OverLength = Literal["truncate", "drop"]
Objective = Literal["sft", "dpo", "grpo"]
DpoLoss = Literal["sigmoid", "ipo", "simpo"]
GrpoLoss = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
LossType = Literal[DpoLoss, GrpoLoss]
DPO_LOSSES: tuple[str, ...] = ("sigmoid", "ipo", "simpo")
GRPO_LOSSES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo")
ScaleRewards = Literal["group", "batch", "none"]
ImportanceLevel = Literal["token", "sequence"]
TargetModules = list[str] | Literal["all-linear"]

# Before/after samples (training.samples): bounded so sampling stays a small share of a job's time.
MAX_SAMPLE_PROMPTS = 32
MAX_SAMPLE_CHARS = 4000
MAX_SAMPLE_MESSAGES = 16
SAMPLE_ROLES = ("system", "user", "assistant")


class SampleMessage(BaseModel):
    """One chat message of a sample prompt (core.data's roles; the last message is a user turn)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Literal["system", "user", "assistant"]
    content: str


SamplePrompt = str | list[SampleMessage]


@dataclass(frozen=True)
class LoraArgs:
    """The adapter a job trains (method lora, or qlora on a 4-bit NF4 base; full trains the whole model
    and is planned only), its shape, and what it starts from: a fresh adapter, or the adapter of an
    earlier job (init_from), at one of its checkpoints (init_from_step)."""

    method: Method
    r: int
    alpha: float
    dropout: float
    target_modules: TargetModules
    init_from: str | None
    init_from_step: int | None

    @property
    def full(self) -> bool:
        """Method full: every parameter is trained, no adapter."""
        return self.method == "full"

    @property
    def quantized(self) -> bool:
        """Method qlora: the frozen base is 4-bit NF4."""
        return self.method == "qlora"

    @property
    def scaling(self) -> float:
        """What the adapter's product is multiplied by (peft's lora_alpha / r)."""
        return self.alpha / self.r

    @staticmethod
    def check_target_modules(v: list[str] | str) -> list[str] | str:
        """lora_target_modules alone (JobSpec's field validator: loc lora_target_modules)."""
        if isinstance(v, list):
            if not v:
                raise ValueError("must name at least one module, or be 'all-linear'")
            bad = [m for m in v if not MODULE_NAME_RE.match(m)]
            if bad:
                raise ValueError(f"invalid module names: {bad}")
        return v

    def check(self) -> None:
        if self.init_from_step is not None and self.init_from is None:
            raise ValueError("init_from_step needs init_from (the job whose checkpoint to continue from)")


@dataclass(frozen=True)
class OptimArgs:
    """The optimizer and its learning-rate schedule: linear warmup (warmup_steps, or warmup_ratio of the
    run's steps), then constant, linear or cosine decay; gradients clipped to max_grad_norm."""

    optimizer: Optimizer
    learning_rate: float
    lr_scheduler: Scheduler
    warmup_steps: int
    warmup_ratio: float | None
    weight_decay: float
    max_grad_norm: float | None

    def warmup_steps_for(self, total_steps: int) -> int:
        """Warmup steps of a run of `total_steps` optimizer steps."""
        if self.warmup_ratio is not None:
            return round(self.warmup_ratio * total_steps)
        return self.warmup_steps

    @property
    def clip_norm(self) -> float:
        """The norm gradients are clipped to; infinity when clipping is off (max_grad_norm null)."""
        return self.max_grad_norm if self.max_grad_norm is not None else float("inf")


@dataclass(frozen=True)
class DataArgs:
    """The training dataset, what is held out to evaluate on (a fraction of it, or a second dataset),
    when evaluation runs and stops the job, and how an example becomes tokens."""

    dataset_id: str
    validation_dataset_id: str | None
    validation_fraction: float
    eval_every_steps: int
    early_stopping_patience: int | None
    early_stopping_min_delta: float
    max_seq_len: int
    over_length: OverLength
    train_on_inputs: bool

    @property
    def has_validation(self) -> bool:
        return bool(self.validation_fraction or self.validation_dataset_id)

    def check(self) -> None:
        if self.validation_fraction and self.validation_dataset_id:
            raise ValueError("set validation_fraction or validation_dataset_id, not both")
        if self.early_stopping_patience and not self.has_validation:
            raise ValueError("early_stopping_patience needs validation_fraction or validation_dataset_id")


@dataclass(frozen=True)
class BatchArgs:
    """What one optimizer step trains (training.batches): a global batch fixed before it is split, of
    micro x accumulation x ranks rows, or with `examples_per_step` of that many examples (packed: into
    as many rows as they fill). A row is one example padded (packing false), or examples packed into
    max_seq_len tokens per sequence of an example; an example is `sequences_per_example` sequences (a
    preference pair: two)."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    num_gpus: int  # the step's ranks: the spec's num_gpus x num_nodes
    max_seq_len: int
    packing: bool
    sequences_per_example: int
    examples_per_step: int | None = None

    @property
    def effective_size(self) -> int:
        """Rows in an optimizer step's global batch: the effective batch size (without examples_per_step)."""
        return self.micro_batch_size * self.gradient_accumulation_steps * self.num_gpus

    @property
    def step_size(self) -> int:
        """What a full step counts: examples_per_step examples, else effective_size rows."""
        return self.examples_per_step or self.effective_size

    @property
    def row_capacity(self) -> int:
        """Tokens a packed row holds: max_seq_len per sequence of an example."""
        return self.max_seq_len * self.sequences_per_example

    @property
    def micro_sequences(self) -> int:
        """Sequences in a padded micro-batch (a preference pair is two)."""
        return self.micro_batch_size * self.sequences_per_example

    @property
    def worst_case_tokens(self) -> int:
        """Tokens of a micro-batch whose every sequence is max_seq_len long."""
        return self.micro_sequences * self.max_seq_len


@dataclass(frozen=True)
class PreferenceArgs:
    """The objective and its loss: sft (next-token loss on the targets); dpo on preference pairs with
    DPO's loss (sigmoid, ipo, or the reference-free simpo) and an optional NLL term (rpo_alpha); grpo
    (reinforcement fine-tuning, RLArgs) with GRPO's loss types, beta its KL weight. Every field but the
    objective is dpo's (beta and loss_type grpo's too): sft refuses a value other than its default."""

    objective: Objective
    beta: float
    loss_type: LossType
    simpo_gamma: float
    rpo_alpha: float

    @property
    def enabled(self) -> bool:
        """Preference training (objective dpo): the data are preference pairs."""
        return self.objective == "dpo"

    @property
    def uses_reference(self) -> bool:
        """Whether a reference policy runs: DPO's sigmoid and ipo losses compare with one; grpo with a KL
        term (beta > 0) does; simpo, grpo without KL and sft have none."""
        if self.objective == "grpo":
            return self.beta > 0
        return self.enabled and self.loss_type != "simpo"

    def check(self, train_on_inputs: bool, defaults: Mapping[str, Any]) -> None:
        """`defaults`: the group's fields at JobSpec's defaults, in their order (core.spec.group_defaults)."""
        if self.objective == "sft":
            # Only values other than the defaults (a spec read back from JSON has every field set).
            odd = [f for f in defaults if f != "objective" and getattr(self, f) != defaults[f]]
            shared = [f for f in odd if f in ("beta", "loss_type")]
            if shared:
                raise ValueError(f"{', '.join(shared)} apply to objectives 'dpo' and 'grpo' only")
            if odd:
                raise ValueError(f"{', '.join(odd)} apply to objective 'dpo' only")
            return
        if train_on_inputs:
            raise ValueError(
                f"train_on_inputs applies to objective 'sft' only ({self.objective} trains the completions)"
            )
        if self.objective == "grpo":
            if self.loss_type not in GRPO_LOSSES:
                raise ValueError(f"loss_type for objective 'grpo' is one of {', '.join(GRPO_LOSSES)}")
            odd = [f for f in ("simpo_gamma", "rpo_alpha") if getattr(self, f) != defaults[f]]
            if odd:
                raise ValueError(f"{', '.join(odd)} apply to objective 'dpo' only")
            return
        if self.loss_type not in DPO_LOSSES:
            raise ValueError(f"loss_type for objective 'dpo' is one of {', '.join(DPO_LOSSES)}")
        if self.beta <= 0:
            raise ValueError("beta must be greater than 0 for objective 'dpo'")
        if self.simpo_gamma != defaults["simpo_gamma"] and self.loss_type != "simpo":
            raise ValueError("simpo_gamma applies to loss_type 'simpo' only")


@dataclass(frozen=True)
class RLArgs:
    """Reinforcement fine-tuning (objective grpo, training.objectives.grpo): each prompt of a step is
    answered `num_generations` times by the policy being trained (sampled at `temperature`, at most
    `max_completion_tokens` new tokens), each answer graded (`grader`, OpenAI's grader JSON,
    graders), and the policy moved by GRPO's clipped objective on the group-relative advantages.
    `eval_samples`: validation prompts graded at each evaluation (None: all of them). generate() samples
    `rollout_prompts` prompts at a time (rollout_batch_size, or all of the step's: fewer decoding steps,
    each no dearer while decoding is bound by the host's work per step, as on a GPU; and the samples do
    not depend on how the step is split into micro-batches)."""

    objective: Objective
    grader: dict[str, Any] | None
    num_generations: int
    temperature: float
    rollout_batch_size: int | None
    max_completion_tokens: int
    response_format: dict[str, Any] | None
    epsilon: float
    epsilon_high: float | None
    scale_rewards: ScaleRewards
    importance_sampling_level: ImportanceLevel
    eval_samples: int | None
    max_seq_len: int
    step_prompts: int  # a step's prompts (BatchArgs.step_size: a grpo row is one prompt)

    @property
    def enabled(self) -> bool:
        return self.objective == "grpo"

    @property
    def epsilon_upper(self) -> float:
        """The ratio's upper clip is 1 + epsilon_high (DAPO's clip-higher), epsilon when not set."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def rollout_prompts(self) -> int:
        """Prompts per generate() call: rollout_batch_size, at most a step's prompts."""
        return min(self.rollout_batch_size or self.step_prompts, self.step_prompts)

    @property
    def rollout_sequences(self) -> int:
        """Sequences generate() samples at once: rollout_prompts x num_generations."""
        return self.rollout_prompts * self.num_generations

    @property
    def max_prompt_tokens(self) -> int:
        """A prompt plus its completion fit max_seq_len."""
        return self.max_seq_len - self.max_completion_tokens

    def check(self, defaults: Mapping[str, Any]) -> None:
        """`defaults`: the group's own fields (each grpo's only) at JobSpec's defaults, the values sft and
        dpo must keep (core.spec.group_defaults)."""
        if not self.enabled:
            odd = [f for f in defaults if getattr(self, f) != defaults[f]]
            if odd:
                raise ValueError(f"{', '.join(odd)} apply to objective 'grpo' only")
            return
        if self.grader is None:
            raise ValueError("objective 'grpo' needs a grader (OpenAI's grader JSON, e.g. string_check)")
        if self.max_prompt_tokens < 8:
            raise ValueError(
                f"max_completion_tokens ({self.max_completion_tokens}) leaves under 8 tokens of "
                f"max_seq_len ({self.max_seq_len}) for the prompt"
            )


@dataclass(frozen=True)
class SampleArgs:
    """Before/after samples (training.samples): greedy completions of the base and of the tuned model for
    `prompts` (a number to take from the data, or the prompts themselves), at the end and, with
    `at_eval`, at each evaluation."""

    prompts: int | list[SamplePrompt]
    max_tokens: int
    at_eval: bool

    @property
    def enabled(self) -> bool:
        return bool(self.prompts)

    @property
    def given(self) -> list[SamplePrompt] | None:
        """The prompts the spec gives itself; None when it asks for a number of prompts from the data."""
        return self.prompts if isinstance(self.prompts, list) else None

    @staticmethod
    def check_prompts(v: Any) -> Any:
        """sample_prompts alone, as given, before pydantic's union (JobSpec's field validator: loc
        sample_prompts), so that each problem is one clear message."""
        if isinstance(v, int) and not isinstance(v, bool):
            if not 0 <= v <= MAX_SAMPLE_PROMPTS:
                raise ValueError(f"a number of prompts must be 0-{MAX_SAMPLE_PROMPTS}")
            return v
        if not isinstance(v, list):
            raise ValueError(f"must be a number of prompts (0-{MAX_SAMPLE_PROMPTS}) or a list of prompts")
        if not 1 <= len(v) <= MAX_SAMPLE_PROMPTS:
            raise ValueError(f"a list must hold 1-{MAX_SAMPLE_PROMPTS} prompts, not {len(v)}")
        return [_check_sample_prompt(i, p) for i, p in enumerate(v)]

    def check(self, has_validation: bool) -> None:
        if self.at_eval and not self.prompts:
            raise ValueError("sample_at_eval needs sample_prompts")
        if self.at_eval and not has_validation:
            raise ValueError("sample_at_eval needs validation_fraction or validation_dataset_id")


def _check_sample_prompt(i: int, p: Any) -> Any:
    """One prompt of sample_prompts (a string, or chat messages ending with a user turn), as given."""
    where = f"prompt {i}"
    if isinstance(p, str):
        if not p.strip():
            raise ValueError(f"{where} is empty")
        if len(p) > MAX_SAMPLE_CHARS:
            raise ValueError(f"{where} is over {MAX_SAMPLE_CHARS} characters")
        return p
    if not isinstance(p, list) or not p:
        raise ValueError(f"{where} must be a string or a non-empty list of chat messages")
    if len(p) > MAX_SAMPLE_MESSAGES:
        raise ValueError(f"{where} has over {MAX_SAMPLE_MESSAGES} messages")
    total = 0
    for j, m in enumerate(p):
        if isinstance(m, SampleMessage):
            m = m.model_dump()
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise ValueError(f"{where}, message {j} must be an object with role and content only")
        if m["role"] not in SAMPLE_ROLES:
            raise ValueError(f"{where}, message {j}: role must be one of {', '.join(SAMPLE_ROLES)}")
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise ValueError(f"{where}, message {j}: content must be a non-empty string")
        total += len(m["content"])
    if total > MAX_SAMPLE_CHARS:
        raise ValueError(f"{where} is over {MAX_SAMPLE_CHARS} characters")
    last = p[-1].role if isinstance(p[-1], SampleMessage) else p[-1]["role"]
    if last != "user":
        raise ValueError(f"{where} must end with a user message")
    return p


@dataclass(frozen=True)
class PlacementArgs:
    """Where and how the job runs: on how many devices and nodes (FSDP over more than one), at what precision,
    with which attention kernel, and whether activations are recomputed (gradient checkpointing)."""

    num_gpus: int  # per node
    num_nodes: int
    torch_dtype: TorchDtype
    mixed_precision: MixedPrecision
    master_weights: bool
    attn_implementation: AttnImpl
    gradient_checkpointing: bool

    @property
    def world_size(self) -> int:
        """The job's ranks: num_gpus on each of num_nodes workers."""
        return self.num_gpus * self.num_nodes

    @property
    def sharded(self) -> bool:
        """More than one device: FSDP shards the model, its gradients and optimizer states."""
        return self.world_size > 1

    @staticmethod
    def default_checkpointing(method: Any) -> bool:
        """gradient_checkpointing when the spec leaves it null: on for qlora, off otherwise."""
        return method == "qlora"


V = TypeVar("V")


@dataclass(frozen=True, eq=False)  # one object a group: compared and hashed as itself (the views' cache keys)
class Group(Generic[V]):
    """A group of JobSpec fields, named on each field's declaration (`lora_r: Annotated[int, LORA]`):
    `doc` heads its section of docs/job_spec.md; `view` is the class `spec.<name>` returns (None: no view);
    a view names the group's fields less `prefix`."""

    name: str
    doc: str
    view: type[V] | None = None
    prefix: str = ""


@dataclass(frozen=True)
class GrpoDefault:
    """On a field's declaration: its default for objective grpo where that differs (TRL 1.16's
    GRPOConfig: no KL term, DAPO's token-level loss); JobSpec fills it in when a grpo spec leaves the field
    out."""

    value: Any


RUN = Group[None]("run", "The job: its base model, how long it trains, its checkpoints and export, its turn.")
LORA = Group("lora", "The adapter: its method and shape, and what it starts from.", LoraArgs, "lora_")
DATA = Group("data", "The dataset, how examples become tokens, and evaluation on a held-out split.", DataArgs)
BATCH = Group("batch", "What one optimizer step trains.", BatchArgs)
OPTIM = Group("optim", "The optimizer and its learning-rate schedule.", OptimArgs)
PREFERENCE = Group("preference", "The objective and its loss (preference tuning: dpo).", PreferenceArgs)
RL = Group("rl", "Reinforcement fine-tuning (objective grpo): grading, rollouts, clipping.", RLArgs)
SAMPLES = Group(
    "samples",
    "Before/after samples: greedy completions of the base and the tuned model.",
    SampleArgs,
    "sample_",
)
PLACEMENT = Group("placement", "Devices, precision, attention and activation checkpointing.", PlacementArgs)
GROUPS: tuple[Group[Any], ...] = (RUN, LORA, DATA, BATCH, OPTIM, PREFERENCE, RL, SAMPLES, PLACEMENT)
