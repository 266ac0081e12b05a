"""JobSpec: the one typed contract that goes API -> database JSON -> run.json -> training.

A flat JSON object a curl user can write by hand. Every field but the first two has a default;
unknown fields are refused and every problem is reported at once (pydantic collects them).

Bounds are what a sane LoRA/QLoRA job can use, so a typo (lr 2, rank 100000) is a 422 and not a
worker busy for days or a planner asked about absurd sizes:
- lora_r <= 512: beyond that an adapter costs about what the full fine-tune does; use method full.
- max_seq_len <= 131072 (128k tokens), micro_batch_size <= 512, gradient_accumulation_steps <= 1024,
  examples_per_step <= 524288.
- epochs <= 100, max_steps <= 1,000,000, warmup_steps <= 100,000.
- keep_checkpoints <= 100: each is the adapter and its optimizer state; all count in the storage quota.
- learning_rate in (0, 0.1]: AdamW diverges well below 0.1; LoRA typically uses 1e-5 .. 1e-3.
- weight_decay <= 1, max_grad_norm <= 1000, lora_dropout < 0.9, num_gpus <= 256.
- at most 64 target modules; no NaN or infinity anywhere (they are not JSON either).
- before/after samples: at most 32 prompts of at most 4000 characters (16 messages), 1-512 new tokens.

Code reads the fields of one idea through its group (core.spec_groups): spec.lora, spec.optim, spec.data,
spec.batch, spec.preference, spec.rl, spec.samples, spec.placement, typed views that hold the checks
across fields and the values derived from them (the effective batch, whether a reference policy runs, ...).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from core.spec_groups import (
    DPO_FIELDS,
    GRPO_DEFAULTS,
    MAX_SAMPLE_CHARS,
    MAX_SAMPLE_MESSAGES,
    MAX_SAMPLE_PROMPTS,
    MODULE_NAME_RE,
    SAMPLE_ROLES,
    SFT,
    AttnImpl,
    BatchArgs,
    DataArgs,
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
)

__all__ = [
    "DPO_FIELDS",
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
]

# Base model names: a local directory name or a hub-style "org/name" id. Never a path.
MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
ID_RE = re.compile(r"^[a-z0-9]{8,64}$")


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    base_model: str = Field(description="Name of a local base model (see GET /models).")
    dataset_id: str = Field(description="Id of an uploaded, valid dataset.")

    method: Method = Field(
        "lora", description="lora, qlora (4-bit NF4 base) or full (planned only, not trained)."
    )
    lora_r: int = Field(16, ge=1, le=512)
    lora_alpha: float = Field(32, gt=0, le=2048)
    lora_dropout: float = Field(0.05, ge=0, lt=0.9)
    lora_target_modules: Annotated[list[str], Field(max_length=64)] | Literal["all-linear"] = "all-linear"

    epochs: int = Field(1, ge=1, le=100)
    max_steps: int | None = Field(None, ge=1, le=1_000_000, description="Overrides epochs when set.")
    micro_batch_size: int = Field(4, ge=1, le=512)
    gradient_accumulation_steps: int = Field(1, ge=1, le=1024)
    examples_per_step: int | None = Field(
        None,
        ge=1,
        le=512 * 1024,
        description="Examples (dpo: pairs; grpo: prompts) in every optimizer step, however packing fills "
        "rows: a step's examples are packed, cut into micro-batches of micro_batch_size rows and dealt to "
        "the GPUs, as many micro-batches as they fill (gradient_accumulation_steps then forms no step). "
        "null: a step is micro_batch_size x gradient_accumulation_steps x num_gpus rows (packed: rows of "
        "many examples). /v1's batch_size sets it.",
    )
    max_seq_len: int = Field(512, ge=8, le=131_072)
    over_length: OverLength = Field(
        "truncate", description="Examples longer than max_seq_len: truncate them, or drop them."
    )
    train_on_inputs: bool = Field(
        False,
        description="Train on the inputs too (system and user turns, instruction, prompt, template markup); "
        "false: only on replies and completions. Assistant turns with weight 0 are never trained.",
    )
    packing: bool = Field(
        True,
        description="Pack examples into padding-free micro-batches of up to micro_batch_size * max_seq_len "
        "tokens, attention per example; false: padded, length-grouped micro-batches of micro_batch_size.",
    )

    # Preference tuning (README "Preference tuning (DPO)"): the objective, its loss and its reference.
    # The defaults are PreferenceArgs' (SFT), which the check of dpo-only fields compares with.
    objective: Objective = Field(
        SFT.objective,
        description="sft: next-token loss on the targets; dpo: preference pairs (a preference dataset); "
        "grpo: reinforcement fine-tuning on prompts (a reinforcement dataset) scored by `grader`.",
    )
    beta: float = Field(
        SFT.beta,
        ge=0,
        le=100,
        description="dpo: how far from the reference (sigmoid, simpo), IPO's tau (ipo); > 0. grpo: the "
        "weight of the KL term to the reference (default 0: none).",
    )
    loss_type: LossType = Field(
        SFT.loss_type,
        description="dpo: sigmoid (the DPO paper), ipo, or simpo (reference-free, length-normalised). grpo: "
        "grpo, bnpo, dr_grpo or dapo (the default), as TRL's GRPOTrainer names them.",
    )
    simpo_gamma: float = Field(
        SFT.simpo_gamma, ge=0, le=100, description="simpo: the target reward margin gamma."
    )
    rpo_alpha: float = Field(
        SFT.rpo_alpha,
        ge=0,
        le=100,
        description="dpo: weight of an added NLL term on the chosen completions (RPO).",
    )
    # Reinforcement fine-tuning (README "Reinforcement fine-tuning"): objective grpo's rollouts and clipping.
    grader: dict[str, Any] | None = Field(
        None,
        description="grpo: OpenAI's grader JSON (string_check, text_similarity, python, score_model, multi) "
        "that scores each sampled completion against its dataset row.",
    )
    num_generations: int = Field(
        4, ge=2, le=64, description="grpo: completions sampled per prompt (a group)."
    )
    temperature: float = Field(1.0, gt=0, le=2, description="grpo: the sampling temperature of rollouts.")
    rollout_batch_size: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="grpo: prompts sampled together in one generate() call, each with its num_generations "
        "answers; null: all of a step's prompts (micro_batch_size x gradient_accumulation_steps), as TRL "
        "samples a step's batch at once. Smaller: less KV cache, more decoding steps.",
    )
    max_completion_tokens: int = Field(
        64, ge=1, le=8192, description="grpo: new tokens per sampled completion at most."
    )
    epsilon: float = Field(0.2, gt=0, le=1, description="grpo: the ratio's lower clip, 1 - epsilon.")
    epsilon_high: float | None = Field(
        None, gt=0, le=10, description="grpo: the ratio's upper clip, 1 + epsilon_high (default epsilon)."
    )
    scale_rewards: ScaleRewards = Field(
        "group",
        description="grpo: advantages divided by the std of the group's rewards, the batch's, or none.",
    )
    importance_sampling_level: ImportanceLevel = Field(
        "token", description="grpo: importance ratios per token, or per sequence (GSPO)."
    )
    eval_samples: int | None = Field(
        None, ge=1, le=100_000, description="grpo: validation prompts graded at each evaluation (all: null)."
    )
    init_from: str | None = Field(
        None,
        description="Continue from the adapter of an earlier succeeded job of the same tenant and base "
        "model (its id); with dpo that adapter, frozen, is also the reference policy.",
    )
    init_from_step: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="With init_from: continue from that job's checkpoint at this step (a kept one) "
        "instead of its final adapter.",
    )

    learning_rate: float = Field(2e-4, gt=0, le=0.1)
    lr_scheduler: Scheduler = "linear"
    warmup_steps: int = Field(0, ge=0, le=100_000)
    warmup_ratio: float | None = Field(
        None, ge=0, lt=1, description="Warmup as a fraction of the total steps; overrides warmup_steps."
    )
    weight_decay: float = Field(0.0, ge=0, le=1)
    max_grad_norm: float | None = Field(
        1.0, gt=0, le=1000, description="Clip gradients to this norm; null: off."
    )
    optimizer: Optimizer = "adamw"
    seed: int = Field(42, ge=0, le=2**32 - 1)

    # Evaluation on a held-out split: a fraction of the training file, or a second uploaded dataset.
    validation_fraction: float = Field(0.0, ge=0, le=0.5, description="Hold out this share for eval.")
    validation_dataset_id: str | None = Field(None, description="A valid dataset to evaluate on.")
    eval_every_steps: int = Field(
        0, ge=0, le=1_000_000, description="0: evaluate at each epoch end and at the end."
    )
    early_stopping_patience: int | None = Field(
        None, ge=1, le=1000, description="Stop after this many evaluations without a better eval loss."
    )
    early_stopping_min_delta: float = Field(
        0.0, ge=0, le=1000, description="Smallest eval-loss drop that counts."
    )
    export: Literal["adapter", "merged"] = Field(
        "adapter", description="merged: also export the base model with the adapter merged in."
    )

    # Before/after samples (README "Samples before and after"): greedy completions of the base (adapter
    # disabled) and of the tuned model. Off by default: sampling adds generation time to every job and
    # its KV cache is not in the plan, so a job pays for it only when asked.
    sample_prompts: int | list[SamplePrompt] = Field(
        0,
        description="N (0-32): up to N prompts from the validation split (without one, the training "
        "file's first examples); or a list of up to 32 prompts, each a string or a list of chat messages "
        "ending with a user turn. 0: no samples.",
    )
    sample_max_tokens: int = Field(64, ge=1, le=512, description="New tokens per sample completion.")
    sample_at_eval: bool = Field(
        False, description="Also sample at each evaluation (needs validation); false: at the end only."
    )

    # None means the method's default: on for qlora, off otherwise.
    gradient_checkpointing: bool | None = None
    checkpoint_every_steps: int = Field(50, ge=0, le=1_000_000, description="0: only at the end.")
    keep_checkpoints: int = Field(
        3,
        ge=1,
        le=100,
        description="Checkpoints kept on disk: the newest N, plus the best by eval loss. They count in the "
        "tenant's storage quota.",
    )

    torch_dtype: TorchDtype = Field("auto", description="Storage dtype of unquantized base weights.")
    mixed_precision: MixedPrecision = Field("auto", description="auto: bf16 on a GPU, off on a CPU.")
    master_weights: bool = Field(False, description="Keep fp32 master copies (full fine-tune).")
    attn_implementation: AttnImpl = "sdpa"
    num_gpus: int = Field(1, ge=1, le=256)
    priority: int = Field(
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

    @field_validator("grader", mode="before")
    @classmethod
    def _grader(cls, v: Any) -> dict[str, Any] | None:
        """The whole grader tree checked now (a bad one is a 4xx naming its field, not a failed job);
        whether python graders may run is the service's policy, checked at admission. Before pydantic's
        own validation, which would copy a 1 MiB grader whole before parse_grader bounds its size."""
        if v is None:
            return v
        from core.graders import parse_grader

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
        self.preference.check(train_on_inputs=self.train_on_inputs)
        self.rl.check(defaults=RL_DEFAULTS)
        self.data.check()
        return self

    # The groups (core.spec_groups): read-only views of the fields above, built on each access.

    @property
    def lora(self) -> LoraArgs:
        return LoraArgs(
            method=self.method,
            r=self.lora_r,
            alpha=self.lora_alpha,
            dropout=self.lora_dropout,
            target_modules=self.lora_target_modules,
            init_from=self.init_from,
            init_from_step=self.init_from_step,
        )

    @property
    def optim(self) -> OptimArgs:
        return OptimArgs(
            optimizer=self.optimizer,
            learning_rate=self.learning_rate,
            lr_scheduler=self.lr_scheduler,
            warmup_steps=self.warmup_steps,
            warmup_ratio=self.warmup_ratio,
            weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm,
        )

    @property
    def data(self) -> DataArgs:
        return DataArgs(
            dataset_id=self.dataset_id,
            validation_dataset_id=self.validation_dataset_id,
            validation_fraction=self.validation_fraction,
            eval_every_steps=self.eval_every_steps,
            early_stopping_patience=self.early_stopping_patience,
            early_stopping_min_delta=self.early_stopping_min_delta,
            max_seq_len=self.max_seq_len,
            over_length=self.over_length,
            train_on_inputs=self.train_on_inputs,
        )

    @property
    def batch(self) -> BatchArgs:
        return BatchArgs(
            micro_batch_size=self.micro_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            num_gpus=self.num_gpus,
            max_seq_len=self.max_seq_len,
            packing=self.packing and self.objective != "grpo",  # grpo: a row is a prompt (RLArgs)
            sequences_per_example=self.sequences_per_example,
            examples_per_step=self.examples_per_step,
        )

    @property
    def preference(self) -> PreferenceArgs:
        return PreferenceArgs(
            objective=self.objective,
            beta=self.beta,
            loss_type=self.loss_type,
            simpo_gamma=self.simpo_gamma,
            rpo_alpha=self.rpo_alpha,
        )

    @property
    def rl(self) -> RLArgs:
        return RLArgs(
            objective=self.objective,
            grader=self.grader,
            num_generations=self.num_generations,
            temperature=self.temperature,
            rollout_batch_size=self.rollout_batch_size,
            max_completion_tokens=self.max_completion_tokens,
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            scale_rewards=self.scale_rewards,
            importance_sampling_level=self.importance_sampling_level,
            eval_samples=self.eval_samples,
            max_seq_len=self.max_seq_len,
            step_prompts=self.batch.step_size,
        )

    @property
    def samples(self) -> SampleArgs:
        return SampleArgs(
            prompts=self.sample_prompts, max_tokens=self.sample_max_tokens, at_eval=self.sample_at_eval
        )

    @property
    def placement(self) -> PlacementArgs:
        return PlacementArgs(
            num_gpus=self.num_gpus,
            torch_dtype=self.torch_dtype,
            mixed_precision=self.mixed_precision,
            master_weights=self.master_weights,
            attn_implementation=self.attn_implementation,
            gradient_checkpointing=bool(self.gradient_checkpointing),
        )

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


# The rl group of a spec with every field at its default: what sft and dpo must leave unchanged.
RL_DEFAULTS = RLArgs(
    objective="sft",
    **{f: JobSpec.model_fields[f].default for f in RLArgs.FIELDS},
    max_seq_len=JobSpec.model_fields["max_seq_len"].default,
    step_prompts=JobSpec.model_fields["micro_batch_size"].default,  # unused: sft and dpo sample nothing
)
