"""What every objective's optimizer step shares: the model's parts, accumulation, clipping, the update.

A step's global batch (training.batches) is split into micro-batches; this rank runs its share
(rank_micro_batches). What a micro-batch contributes is the objective's (`accumulate_gradients(loss_fn)`):
its share of the step's loss, normalised by the step's totals over all its micro-batches and ranks (sft:
its token losses over the step's target tokens, training.objectives.sft; dpo: its pairs' losses over the
step's pairs; grpo: its completions' over the step's sequences or tokens), so accumulation gives the same
gradient as one big batch, whatever the lengths, the micro-batch size or the number of ranks. Under FSDP
(training.distributed) the ranks' gradients are summed, not averaged, for the same reason. LoRA dropout
masks belong to examples (training.dropout), so they do not depend on the split either.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from core.spec import JobSpec
from training import distributed, dropout
from training.batches import Step, rank_share, split_step
from training.data import Tokenized, collate
from training.packing import collate_packed

Batch = dict[str, torch.Tensor | int]  # training.data.collate or training.packing.collate_packed


@dataclass
class Position:
    """Where training is: resumable from these numbers alone (the steps are a pure function)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    step_in_epoch: int = 0  # next step within the epoch
    tokens_seen: int = 0  # input tokens processed
    elapsed_s: float = 0.0  # training time, summed over resumed runs
    losses: list[float] = field(default_factory=list)  # loss of every step so far
    best_eval_loss: float | None = None  # early stopping: the best validation loss so far
    evals_without_improvement: int = 0
    stopped_early: bool = False


@dataclass(frozen=True)
class Parts:
    """The model and what updates it, built once by the recipe's setup (a record; no behaviour)."""

    spec: JobSpec
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    device: torch.device
    autocast: Callable[[], AbstractContextManager[object]] = nullcontext
    scaler: torch.amp.GradScaler | None = None


@dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    tokens: int  # input tokens (not padding) processed in the step
    target_tokens: int  # tokens the loss is taken on
    lr: float
    # The objective's own metrics, what it adds to the step record (sft: token accuracy; dpo: rewards,
    # accuracy, log-probs; grpo: rl), and to the step's log line.
    fields: dict[str, Any] = field(default_factory=dict)
    note: str = ""


def make_optimizer(spec: JobSpec, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    o = spec.optim
    kwargs = {"lr": o.learning_rate, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": o.weight_decay}
    if o.optimizer == "adamw":
        return torch.optim.AdamW(params, **kwargs)  # type: ignore[arg-type]
    import bitsandbytes as bnb

    if o.optimizer == "adamw_8bit":
        return bnb.optim.AdamW8bit(params, **kwargs)
    return bnb.optim.PagedAdamW8bit(params, **kwargs)


def lr_at(spec: JobSpec, step: int, total: int) -> float:
    """Learning rate of the optimizer step that follows `step` completed steps.

    Warmup ramps linearly so the first step already moves (lr/warmup, not 0); decay then goes
    linearly or along a half cosine towards 0 at `total`.
    """
    o = spec.optim
    warmup = o.warmup_steps_for(total)
    if step < warmup:
        return o.learning_rate * (step + 1) / warmup
    if o.lr_scheduler == "constant":
        return o.learning_rate
    progress = (step - warmup) / max(1, total - warmup)
    if o.lr_scheduler == "linear":
        return o.learning_rate * max(0.0, 1.0 - progress)
    return o.learning_rate * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_batch(spec: JobSpec, items: Sequence[Tokenized], indices: Sequence[int], pad_id: int) -> Batch:
    chosen = [items[i] for i in indices]
    return collate_packed(chosen) if spec.packing else dict(collate(chosen, pad_id, spec.max_seq_len))


def count_targets(batch: Batch) -> int:
    return len(batch["target_labels"])  # type: ignore[arg-type]


def rank_micro_batches(spec: JobSpec, lengths: dict[int, int], step: Step) -> tuple[list[list[int]], int]:
    """(this rank's micro-batches of the global batch `step`, as item indices; how many of them are
    padding): `lengths` are the step's items' (training.batches.split_step). The padding batches, at
    the end, repeat a real one and only keep this rank in step with the others' collectives."""
    split = split_step(spec, lengths, step)
    mine, padding = rank_share(len(split), distributed.rank(), distributed.world_size())
    return [split[k] for k in mine] + [split[mine[0] if mine else 0]] * padding, padding


def dropout_layouts(
    spec: JobSpec, items: Sequence[Tokenized], micro: Sequence[Sequence[int]], key: Sequence[int]
) -> list[dropout.Layout] | None:
    """Where each micro-batch's examples sit, for their dropout masks (training.dropout); None: no dropout."""
    return [dropout.layout(spec, items, idx, key) for idx in micro] if spec.lora_dropout else None


def accumulate_gradients(
    parts: Parts,
    micro_batches: list[Batch],
    loss_fn: Callable[[Batch], torch.Tensor],
    padding: int = 0,
    layouts: list[dropout.Layout] | None = None,
) -> torch.Tensor:
    """Backward over the micro-batches of one optimizer step. `loss_fn(batch)`: a micro-batch's share of
    the step's loss, normalised by the step's totals (over all ranks), called once per micro-batch in
    order. The last `padding` batches only keep this rank in step with the others' collectives: their
    loss is weighted 0. `layouts` place each micro-batch's examples for the dropout masks
    (training.dropout). Returns this rank's part of the step's loss, detached: read it once per step, as
    reading a device tensor waits for the device."""
    real = len(micro_batches) - padding
    loss_sum = torch.zeros((), device=parts.device)
    for i, batch in enumerate(micro_batches):
        distributed.gradient_sync(parts.model, i == len(micro_batches) - 1)
        with dropout.placed(parts.model, layouts[i] if layouts else None):
            loss = loss_fn(batch)
            if i >= real:
                loss = loss * 0.0
            (parts.scaler.scale(loss) if parts.scaler else loss).backward()
        loss_sum += loss.detach()
    return loss_sum


def optimizer_step(parts: Parts, lr: float) -> torch.Tensor:
    """Clip, step and zero the gradients; returns the gradient norm before clipping, a device tensor (no
    host sync here: the step reads it with its loss, once)."""
    if parts.scaler:
        parts.scaler.unscale_(parts.optimizer)
    limit = parts.spec.optim.clip_norm  # infinity: clipping off
    # clip_grad_norm_ in two parts, so the norm of sharded gradients is made whole (all ranks) first
    norm = torch.nn.utils.get_total_norm([p.grad for p in parts.params if p.grad is not None])
    norm = distributed.whole(norm)
    torch.nn.utils.clip_grads_with_norm_(parts.params, limit, norm)
    for group in parts.optimizer.param_groups:
        group["lr"] = lr
    if parts.scaler:
        parts.scaler.step(parts.optimizer)
        parts.scaler.update()
    else:
        parts.optimizer.step()
    parts.optimizer.zero_grad(set_to_none=True)
    return norm.detach()
