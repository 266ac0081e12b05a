"""One optimizer step, as plain functions: the loss, token-normalised accumulation, clipping, the update.

A step's global batch (training.batches) is split into micro-batches; this rank runs its share. The
step's loss is the sum of the token losses of all its micro-batches divided by the number of target
tokens in all of them (over all ranks), so accumulation gives the same gradient as one big batch,
whatever the lengths, the micro-batch size or the number of ranks. Under FSDP (training.distributed)
the ranks' gradients are summed, not averaged, for the same reason. LoRA dropout masks belong to
examples (training.dropout), so they do not depend on the split either.

What a micro-batch contributes is pluggable (`accumulate_gradients(loss_fn=...)`): SFT's is its token
loss sum over the step's target tokens (below); DPO's is its pairs' loss over the step's pairs
(training.dpo, whose train_step is this one's twin on pairs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from core.spec import JobSpec
from training import distributed, dropout, moe
from training.batches import Step, rank_share, split_step
from training.data import Tokenized, collate
from training.loss import token_losses
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
    token_accuracy: float | None = None  # sft: share of the step's target tokens predicted right (argmax)
    # What the objective adds to the step record (dpo: rewards, accuracy, log-probs; grpo: rl) and to the
    # step's log line.
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


def token_loss_sum(parts: Parts, batch: Batch, correct: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Sum (not mean) of the next-token cross-entropies of a micro-batch's target tokens, in fp32
    (training.loss: the chunked head). `correct`: gets how many of them the logits' argmax predicts (a
    device tensor, read once per step)."""
    losses, hits = token_losses(parts.model, batch, parts.device, parts.autocast)
    if correct is not None:
        correct.append(hits)
    return losses.sum()


def accumulate_gradients(
    parts: Parts,
    micro_batches: list[Batch],
    total_targets: int | None = None,
    padding: int = 0,
    layouts: list[dropout.Layout] | None = None,
    loss_fn: Callable[[Batch], torch.Tensor] | None = None,
    correct: list[torch.Tensor] | None = None,
    routes: list[moe.Routes] | None = None,
) -> tuple[torch.Tensor, int]:
    """Backward over micro-batches of one optimizer step; gradients end up normalised by the step's
    target tokens, `total_targets` (over all ranks; default: those of `micro_batches`). The last `padding`
    batches only keep this rank in step with the others' collectives: their loss is weighted 0.
    `layouts` place each micro-batch's examples for the dropout masks (training.dropout).
    `loss_fn(batch)`: a micro-batch's share of the step's loss, normalised by the step's totals (over all
    ranks), in place of the token loss over `total_targets` (training.dpo: its pairs' loss over the
    step's pairs). `correct` (token loss only) gets each real micro-batch's count of target tokens the
    argmax predicts. `routes` (token loss only; a MoE base whose config asks for the router's
    load-balancing loss): each micro-batch's examples, whose aux term is added (training.moe). Returns
    (this rank's part of the step's loss, detached: read it once per step, as reading a device tensor
    waits for the device; target tokens)."""
    real = micro_batches[: len(micro_batches) - padding]
    tokens = total_targets if total_targets is not None else sum(count_targets(b) for b in real)
    loss_sum = torch.zeros((), device=parts.device)
    for i, batch in enumerate(micro_batches):
        distributed.gradient_sync(parts.model, i == len(micro_batches) - 1)
        with dropout.placed(parts.model, layouts[i] if layouts else None):
            counts = correct if i < len(real) else None  # a padding batch counts nothing
            if loss_fn or not routes:
                loss = loss_fn(batch) if loss_fn else token_loss_sum(parts, batch, counts) / tokens
            else:
                with moe.router_logits(parts.model, routes[i]) as router:
                    loss = token_loss_sum(parts, batch, counts) / tokens
                loss = loss + router.loss(batch["input_ids"].shape[-1])  # type: ignore[union-attr]
            if i >= len(real):
                loss = loss * 0.0
            (parts.scaler.scale(loss) if parts.scaler else loss).backward()
        loss_sum += loss.detach()
    return loss_sum, tokens


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


def train_step(
    parts: Parts,
    items: Sequence[Tokenized],
    pad_id: int,
    step: Step,
    *,
    lr: float,
    dropout_key: Sequence[int] = (),
) -> StepResult:
    """One optimizer step on the global batch `step` (rows of indices into `items`, training.batches):
    split into micro-batches, this rank's share run, the update applied on every rank. `dropout_key`
    (seed, epoch) seeds the examples' dropout masks (training.dropout)."""
    spec = parts.spec
    lengths = {i: items[i].length for row in step for i in row}
    # Every rank knows the whole step, so the step's token counts need no communication.
    targets = sum(items[i].num_targets for i in lengths)
    split = split_step(spec, lengths, step)
    mine, padding = rank_share(len(split), distributed.rank(), distributed.world_size())
    chosen = [split[k] for k in mine] + [split[mine[0] if mine else 0]] * padding
    micro_batches = [make_batch(spec, items, idx, pad_id) for idx in chosen]
    layouts = [dropout.layout(spec, items, idx, dropout_key) for idx in chosen] if spec.lora_dropout else None
    correct: list[torch.Tensor] = []
    routes = None
    if moe.aux_loss_coef(parts.model):  # the router's load-balancing loss, per example (training.moe)
        routes = [moe.routes(spec, items, idx, sum(lengths.values())) for idx in chosen]
    local_loss, _ = accumulate_gradients(
        parts, micro_batches, targets, padding, layouts, correct=correct, routes=routes
    )
    # the loss and the argmax hits over all micro-batches and ranks: the same whatever the split
    hits = torch.stack(correct).sum() if correct else torch.zeros((), device=local_loss.device)
    sums = distributed.sum_tensor_over_ranks(torch.stack([local_loss.float(), hits.float()]))
    norm = optimizer_step(parts, lr)
    # the step's one host read (each read waits for the device, which then waits for the host)
    loss, right, grad_norm = torch.cat([sums, norm.float().reshape(1).to(sums.device)]).tolist()
    accuracy = right / targets if targets else None
    return StepResult(loss, grad_norm, sum(lengths.values()), targets, lr, token_accuracy=accuracy)
