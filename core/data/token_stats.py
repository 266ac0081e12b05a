"""Token statistics of a job's dataset against its base model's tokenizer: the records.

What jobs.token_stats holds (TokenStats), the one-line summary shown in the job's events, and what a
measurement is asked (StatsRequest) and answers (Compute). Pure, so the planner reads them
(planner.BatchShape.from_token_stats). Who measures them, when, and in which process is told once, in
models.token_stats; the counting itself is training.token_stats.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenStatsStatus = Literal["pending", "ready", "failed"]


class TokenStatsError(BaseModel):
    code: str
    message: str


class TokenStats(BaseModel):
    """What jobs.token_stats holds. Numbers are set once status is "ready"; `error` once "failed"."""

    # Stored JSON may carry more keys than this version knows; they are ignored, never a 500.
    model_config = ConfigDict(extra="ignore")

    status: TokenStatsStatus
    count: int | None = Field(None, description="Examples in the training file.")
    p50: int | None = Field(None, description="Median tokens per example, before truncation.")
    p95: int | None = Field(None, description="95th percentile of tokens per example.")
    max: int | None = Field(None, description="The longest example in tokens.")
    max_seq_len: int | None = None
    over_max_seq_len: int | None = Field(None, description="Examples longer than max_seq_len.")
    over_length: Literal["truncate", "drop"] | None = Field(
        None, description="What happens to the examples longer than max_seq_len."
    )
    dropped: int | None = Field(
        None, description="Examples not trained on: over-long with over_length=drop, or no target tokens."
    )
    packing: bool | None = None
    micro_batches_per_epoch: int | None = None
    steps_per_epoch: int | None = Field(None, description="Optimizer steps in the first epoch.")
    examples_per_micro_batch: float | None = Field(None, description="Mean examples per micro-batch.")
    run_epochs: float | None = Field(
        None,
        description="Passes over the training data the run makes: epochs, or max_steps / steps_per_epoch.",
    )
    # What the planner re-plans the job with (planner.BatchShape): training.batches.largest_micro_batch.
    max_micro_batch_tokens: int | None = Field(
        None, description="Tokens of the largest micro-batch training forms, padding included."
    )
    longest_sequence: int | None = Field(None, description="The widest sequence of a micro-batch in tokens.")
    max_micro_batch_targets: int | None = Field(
        None, description="The most scored tokens in a micro-batch (the positions logits are computed for)."
    )
    # Objective dpo (training.objectives.dpo.pairs): an example is a preference pair, and count, p50,
    # p95, max and over_max_seq_len are of its longer side (prompt + longer reply, what max_seq_len bounds).
    kind: Literal["sft", "preference"] | None = Field(None, description="preference: pairs (dpo).")
    prompt_p50: int | None = Field(None, description="dpo: median prompt tokens.")
    prompt_p95: int | None = None
    prompt_max: int | None = None
    completion_p50: int | None = Field(None, description="dpo: median reply tokens (chosen and rejected).")
    completion_p95: int | None = None
    completion_max: int | None = None
    truncated: int | None = Field(
        None, description="dpo: pairs over max_seq_len that are truncated (prompt first, then the replies)."
    )
    source: Literal["job_created", "training_start"] | None = Field(
        None, description="job_created: computed at submission; training_start: from training's start."
    )
    error: TokenStatsError | None = None


PENDING: dict[str, Any] = {"status": "pending"}


@dataclass(frozen=True)
class StatsRequest:
    """Everything the computation needs, resolved from ids (the job's row, or a job being admitted)."""

    job_id: str  # for the log: the job's id, or "admission"
    model_dir: Path
    dataset_path: Path
    column_mapping: dict[str, str] | None
    spec_json: str


# Returns the value to store ({"status": "ready", ...} or failed(...)), or None when stopped by a shutdown
# (nothing is stored: the job stays "pending" for training's start to fill).
Compute = Callable[[StatsRequest, threading.Event], dict[str, Any] | None]


def failed(code: str, message: str) -> dict[str, Any]:
    return {"status": "failed", "error": {"code": code, "message": message}}


def needs_attention(stats: TokenStats) -> bool:
    """Some examples will not be trained on as written (truncated or dropped)."""
    return bool(stats.over_max_seq_len or stats.dropped)


def summary(stats: TokenStats) -> str:
    """e.g. "token statistics: 200 examples, p50 83 / p95 160 / max 240 tokens; 0 exceed max_seq_len
    512 (truncate); packed: ~14 examples per micro-batch, 15 steps per epoch; the run makes ~4 epochs"."""
    over, limit = stats.over_max_seq_len or 0, stats.max_seq_len
    lengths = f"{stats.count} examples, p50 {stats.p50} / p95 {stats.p95} / max {stats.max} tokens"
    if stats.kind == "preference":
        lengths = (
            f"{stats.count} preference pairs, prompt + longer reply p50 {stats.p50} / p95 {stats.p95} / "
            f"max {stats.max} tokens (prompts p50 {stats.prompt_p50} / max {stats.prompt_max}, replies "
            f"p50 {stats.completion_p50} / max {stats.completion_max})"
        )
    if over:
        fate = "dropped" if stats.over_length == "drop" else "truncated"
        if stats.kind == "preference" and fate == "truncated":
            fate += " (the prompt first, then the replies)"
        parts = [lengths, f"{over} exceed max_seq_len {limit} and will be {fate}"]
    else:
        parts = [lengths, f"0 exceed max_seq_len {limit} ({stats.over_length})"]
    empty = (stats.dropped or 0) - (over if stats.over_length == "drop" else 0)
    if empty > 0:
        parts.append(f"{empty} with no tokens to train on will be dropped")
    if stats.steps_per_epoch is not None and stats.examples_per_micro_batch is not None:
        kind = "packed" if stats.packing else "padded"
        per = f"{stats.examples_per_micro_batch:.3g}"
        parts.append(f"{kind}: ~{per} examples per micro-batch, {stats.steps_per_epoch} steps per epoch")
    if stats.run_epochs is not None:
        parts.append(f"the run makes ~{stats.run_epochs:.3g} epochs")
    text = "token statistics: " + "; ".join(parts)
    return f"warning: {text}" if needs_attention(stats) else text
