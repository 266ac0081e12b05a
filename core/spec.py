"""JobSpec: the one typed contract that goes API -> database JSON -> run.json -> training.

A flat JSON object a curl user can write by hand. Every field but the first two has a default;
unknown fields are refused and every problem is reported at once (pydantic collects them).

Bounds are what a sane LoRA/QLoRA job can use, so a typo (lr 2, rank 100000) is a 422 and not a
worker busy for days or a planner asked about absurd sizes:
- lora_r <= 512: beyond that an adapter costs about what the full fine-tune does; use method full.
- max_seq_len <= 131072 (128k tokens), micro_batch_size <= 512, gradient_accumulation_steps <= 1024.
- epochs <= 100, max_steps <= 1,000,000, warmup_steps <= 100,000.
- learning_rate in (0, 0.1]: AdamW diverges well below 0.1; LoRA typically uses 1e-5 .. 1e-3.
- weight_decay <= 1, max_grad_norm <= 1000, lora_dropout < 0.9, num_gpus <= 256.
- at most 64 target modules; no NaN or infinity anywhere (they are not JSON either).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Base model names: a local directory name or a hub-style "org/name" id. Never a path.
MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
ID_RE = re.compile(r"^[a-z0-9]{8,64}$")
MODULE_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,63}$")

Method = Literal["lora", "qlora", "full"]
Optimizer = Literal["adamw", "adamw_8bit", "paged_adamw_8bit"]
Scheduler = Literal["constant", "linear", "cosine"]
TorchDtype = Literal["auto", "float32", "bfloat16", "float16"]
MixedPrecision = Literal["auto", "no", "bf16", "fp16"]
AttnImpl = Literal["sdpa", "eager", "flash_attention_2"]
OverLength = Literal["truncate", "drop"]
Objective = Literal["sft", "dpo"]
LossType = Literal["sigmoid", "ipo", "simpo"]
# Fields for objective "dpo" only: a value other than the default is refused with "sft".
DPO_FIELDS = ("beta", "loss_type", "simpo_gamma", "rpo_alpha")


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
    objective: Objective = Field(
        "sft",
        description="sft: next-token loss on the targets; dpo: preference pairs (a preference dataset).",
    )
    beta: float = Field(
        0.1, gt=0, le=100, description="dpo: how far from the reference (sigmoid, simpo), IPO's tau (ipo)."
    )
    loss_type: LossType = Field(
        "sigmoid",
        description="dpo: sigmoid (the DPO paper), ipo, or simpo (reference-free, length-normalised).",
    )
    simpo_gamma: float = Field(0.5, ge=0, le=100, description="simpo: the target reward margin gamma.")
    rpo_alpha: float = Field(
        0.0, ge=0, le=100, description="dpo: weight of an added NLL term on the chosen completions (RPO)."
    )
    init_from: str | None = Field(
        None,
        description="Continue from the adapter of an earlier succeeded job of the same tenant and base "
        "model (its id); with dpo that adapter, frozen, is also the reference policy.",
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

    # None means the method's default: on for qlora, off otherwise.
    gradient_checkpointing: bool | None = None
    checkpoint_every_steps: int = Field(50, ge=0, le=1_000_000, description="0: only at the end.")
    keep_checkpoints: int = Field(
        3, ge=1, le=10_000, description="Checkpoints kept on disk: the newest N, plus the best by eval loss."
    )

    torch_dtype: TorchDtype = Field("auto", description="Storage dtype of unquantized base weights.")
    mixed_precision: MixedPrecision = Field("auto", description="auto: bf16 on a GPU, off on a CPU.")
    master_weights: bool = Field(False, description="Keep fp32 master copies (full fine-tune).")
    attn_implementation: AttnImpl = "sdpa"
    num_gpus: int = Field(1, ge=1, le=256)
    priority: int = Field(
        0, ge=-100, le=100, description="Order among this tenant's own queued jobs: higher first, then FIFO."
    )

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

    @model_validator(mode="after")
    def _objective_fields(self) -> JobSpec:
        if self.objective == "sft":
            # Only values other than the defaults (a spec read back from JSON has every field set).
            odd = [f for f in DPO_FIELDS if getattr(self, f) != _DEFAULTS[f]]
            if odd:
                raise ValueError(f"{', '.join(odd)} apply to objective 'dpo' only")
            return self
        if self.train_on_inputs:
            raise ValueError("train_on_inputs applies to objective 'sft' only (dpo trains the completions)")
        if self.simpo_gamma != _DEFAULTS["simpo_gamma"] and self.loss_type != "simpo":
            raise ValueError("simpo_gamma applies to loss_type 'simpo' only")
        return self

    @property
    def uses_reference(self) -> bool:
        """DPO's sigmoid and ipo losses compare with a reference policy; simpo and sft have none."""
        return self.objective == "dpo" and self.loss_type != "simpo"

    @property
    def sequences_per_example(self) -> int:
        """A preference pair is two sequences (prompt + chosen, prompt + rejected)."""
        return 2 if self.objective == "dpo" else 1

    @model_validator(mode="after")
    def _one_validation_source(self) -> JobSpec:
        if self.validation_fraction and self.validation_dataset_id:
            raise ValueError("set validation_fraction or validation_dataset_id, not both")
        if self.early_stopping_patience and not self.has_validation:
            raise ValueError("early_stopping_patience needs validation_fraction or validation_dataset_id")
        return self

    @property
    def has_validation(self) -> bool:
        return bool(self.validation_fraction or self.validation_dataset_id)

    def warmup_steps_for(self, total_steps: int) -> int:
        if self.warmup_ratio is not None:
            return round(self.warmup_ratio * total_steps)
        return self.warmup_steps

    @field_validator("lora_target_modules")
    @classmethod
    def _modules(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, list):
            if not v:
                raise ValueError("must name at least one module, or be 'all-linear'")
            bad = [m for m in v if not MODULE_NAME_RE.match(m)]
            if bad:
                raise ValueError(f"invalid module names: {bad}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _method_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("gradient_checkpointing") is None:
            data = {**data, "gradient_checkpointing": data.get("method") == "qlora"}
        return data

    @property
    def effective_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.num_gpus


_DEFAULTS = {f: JobSpec.model_fields[f].default for f in DPO_FIELDS}
