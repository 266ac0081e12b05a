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
- before/after samples: at most 32 prompts of at most 4000 characters (16 messages), 1-512 new tokens.
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
    def _init_from_step(self) -> JobSpec:
        if self.init_from_step is not None and self.init_from is None:
            raise ValueError("init_from_step needs init_from (the job whose checkpoint to continue from)")
        return self

    @field_validator("sample_prompts", mode="before")
    @classmethod
    def _sample_prompts(cls, v: Any) -> Any:
        # Checked by hand, before pydantic's union, so that each problem is one clear message.
        if isinstance(v, int) and not isinstance(v, bool):
            if not 0 <= v <= MAX_SAMPLE_PROMPTS:
                raise ValueError(f"a number of prompts must be 0-{MAX_SAMPLE_PROMPTS}")
            return v
        if not isinstance(v, list):
            raise ValueError(f"must be a number of prompts (0-{MAX_SAMPLE_PROMPTS}) or a list of prompts")
        if not 1 <= len(v) <= MAX_SAMPLE_PROMPTS:
            raise ValueError(f"a list must hold 1-{MAX_SAMPLE_PROMPTS} prompts, not {len(v)}")
        return [_check_sample_prompt(i, p) for i, p in enumerate(v)]

    @model_validator(mode="after")
    def _samples(self) -> JobSpec:
        if self.sample_at_eval and not self.sample_prompts:
            raise ValueError("sample_at_eval needs sample_prompts")
        if self.sample_at_eval and not self.has_validation:
            raise ValueError("sample_at_eval needs validation_fraction or validation_dataset_id")
        return self

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


_DEFAULTS = {f: JobSpec.model_fields[f].default for f in DPO_FIELDS}
