"""The training loop: explicit functions, no trainer class.

An optimizer step takes up to `gradient_accumulation_steps` micro-batches from the current epoch (the
last step of an epoch may take fewer). Its loss is the sum of the token losses of all its
micro-batches divided by the number of target tokens in all of them, so accumulation gives the same
gradient as one big batch, whatever the lengths.

Under FSDP (training.distributed) a step takes `gradient_accumulation_steps x num_gpus` micro-batches,
the same examples a single process would take with that accumulation; each rank runs its share and
divides by the target tokens of the whole step, and the ranks' gradients are summed. So the global batch,
the loss and the update do not depend on how many processes share the step, and a checkpoint resumes on
any number of them. Dropout is seeded per micro-batch for the same reason.

The micro-batches of an epoch are a pure function of (spec, lengths, epoch): packed (training.packing)
or padded and length-grouped (training.data), so a Position alone says where to resume.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from core.spec import JobSpec
from training import distributed
from training.data import IGNORE, Tokenized, collate, epoch_batches
from training.packing import collate_packed, epoch_packs


@dataclass
class Position:
    """Where training is: resumable from these numbers alone (the data order is a pure function)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_index: int = 0  # next micro-batch within the epoch
    tokens_seen: int = 0  # input tokens processed
    elapsed_s: float = 0.0  # training time, summed over resumed runs
    losses: list[float] = field(default_factory=list)  # loss of every step so far
    best_eval_loss: float | None = None  # early stopping: the best validation loss so far
    evals_without_improvement: int = 0
    stopped_early: bool = False


@dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    tokens: int  # input tokens (not padding) processed in the step
    target_tokens: int  # tokens the loss is taken on
    lr: float
    epoch_ended: bool


@dataclass
class Trainer:
    """What the loop needs, gathered once by training.run (a record, not a class hierarchy)."""

    spec: JobSpec
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    items: Sequence[Tokenized]
    pad_id: int
    device: torch.device
    total_steps: int
    autocast: Callable[[], AbstractContextManager] = nullcontext
    scaler: torch.amp.GradScaler | None = None
    _orders: dict[int, list[list[int]]] = field(default_factory=dict, repr=False)

    def epoch_order(self, epoch: int) -> list[list[int]]:
        if epoch not in self._orders:
            lengths = [len(x.input_ids) for x in self.items]
            self._orders = {epoch: epoch_order(self.spec, lengths, epoch)}
        return self._orders[epoch]

    def make_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor | int]:
        items = [self.items[i] for i in indices]
        return collate_packed(items) if self.spec.packing else collate(items, self.pad_id)


def epoch_order(spec: JobSpec, lengths: Sequence[int], epoch: int) -> list[list[int]]:
    """The micro-batches (lists of example indices) of one epoch."""
    if spec.packing:
        return epoch_packs(lengths, spec.micro_batch_size * spec.max_seq_len, spec.seed, epoch)
    return epoch_batches(lengths, spec.micro_batch_size, spec.seed, epoch)


def step_micro_batches(spec: JobSpec) -> int:
    """Micro-batches in one optimizer step over all ranks: the global batch is micro x accumulation x
    num_gpus, whatever the number of processes that actually share it (a resume may use fewer)."""
    return spec.gradient_accumulation_steps * spec.num_gpus


def total_steps(spec: JobSpec, lengths: Sequence[int]) -> int:
    """Optimizer steps of the run: max_steps, or the steps of all epochs (the last step of an epoch
    may take fewer micro-batches). Packed epochs may differ in their number of micro-batches."""
    if spec.max_steps is not None:
        return spec.max_steps
    accum = step_micro_batches(spec)
    if not spec.packing:
        return spec.epochs * math.ceil(math.ceil(len(lengths) / spec.micro_batch_size) / accum)
    return sum(math.ceil(len(epoch_order(spec, lengths, e)) / accum) for e in range(spec.epochs))


def make_optimizer(spec: JobSpec, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    kwargs = {"lr": spec.learning_rate, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": spec.weight_decay}
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(params, **kwargs)
    import bitsandbytes as bnb

    if spec.optimizer == "adamw_8bit":
        return bnb.optim.AdamW8bit(params, **kwargs)
    return bnb.optim.PagedAdamW8bit(params, **kwargs)


def lr_at(spec: JobSpec, step: int, total: int) -> float:
    """Learning rate of the optimizer step that follows `step` completed steps.

    Warmup ramps linearly so the first step already moves (lr/warmup, not 0); decay then goes
    linearly or along a half cosine towards 0 at `total`.
    """
    warmup = spec.warmup_steps_for(total)
    if step < warmup:
        return spec.learning_rate * (step + 1) / warmup
    if spec.lr_scheduler == "constant":
        return spec.learning_rate
    progress = (step - warmup) / max(1, total - warmup)
    if spec.lr_scheduler == "linear":
        return spec.learning_rate * max(0.0, 1.0 - progress)
    return spec.learning_rate * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def take_step_batches(t: Trainer, pos: Position) -> tuple[list[list[int]], bool]:
    """The micro-batches of the next optimizer step (lists of example indices), and whether they
    finish the epoch. Advances `pos` past them."""
    order = t.epoch_order(pos.epoch)
    chosen = order[pos.batch_index : pos.batch_index + step_micro_batches(t.spec)]
    pos.batch_index += len(chosen)
    ended = pos.batch_index >= len(order)
    if ended:
        pos.epoch += 1
        pos.batch_index = 0
    return chosen, ended


Batch = dict[str, torch.Tensor | int]  # training.data.collate or training.packing.collate_packed


def count_targets(batch: Batch) -> int:
    return int((batch["labels"][:, 1:] != IGNORE).sum())  # type: ignore[index]


def token_loss_sum(t: Trainer, batch: Batch) -> torch.Tensor:
    """Sum (not mean) of the next-token cross-entropies of a micro-batch's target tokens, in fp32."""
    batch = {k: v.to(t.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    labels: torch.Tensor = batch.pop("labels")  # type: ignore[assignment]
    targets = labels[:, 1:] != IGNORE
    # Only positions whose next token is a target need logits: the lm_head and softmax skip prompt
    # and padding tokens (transformers' logits_to_keep takes a boolean mask, output [kept, vocab]).
    keep = F.pad(targets, (0, 1), value=False)
    with t.autocast():
        logits = t.model(**batch, logits_to_keep=keep).logits
    if logits.dim() == 3:  # a model whose forward ignores a boolean logits_to_keep
        logits = logits[:, :-1][targets]
    return F.cross_entropy(logits.float(), labels[:, 1:][targets], reduction="sum")


def micro_batch_seed(seed: int, epoch: int, index: int) -> int:
    """The RNG seed (dropout) of micro-batch `index` of `epoch`: the same on any rank and after a resume."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1)[0])


def accumulate_gradients(
    t: Trainer,
    micro_batches: list[Batch],
    total_targets: int | None = None,
    seeds: list[int] | None = None,
    padding: int = 0,
) -> tuple[float, int]:
    """Backward over micro-batches of one optimizer step; gradients end up normalised by the step's
    target tokens, `total_targets` (over all ranks; default: those of `micro_batches`). The last `padding`
    batches only keep this rank in step with the others' collectives: their loss is weighted 0.
    Returns (this rank's part of the mean token loss, target tokens)."""
    real = micro_batches[: len(micro_batches) - padding]
    tokens = total_targets if total_targets is not None else sum(count_targets(b) for b in real)
    loss_sum = 0.0
    for i, batch in enumerate(micro_batches):
        if seeds is not None:
            torch.manual_seed(seeds[i])
        distributed.gradient_sync(t.model, i == len(micro_batches) - 1)
        loss = token_loss_sum(t, batch) / tokens
        if i >= len(real):
            loss = loss * 0.0
        (t.scaler.scale(loss) if t.scaler else loss).backward()
        loss_sum += loss.item()
    return loss_sum, tokens


def optimizer_step(t: Trainer, lr: float) -> float:
    """Clip, step and zero the gradients; returns the gradient norm before clipping."""
    if t.scaler:
        t.scaler.unscale_(t.optimizer)
    limit = t.spec.max_grad_norm if t.spec.max_grad_norm is not None else math.inf
    # clip_grad_norm_ in two parts, so the norm of sharded gradients is made whole (all ranks) first
    norm = torch.nn.utils.get_total_norm([p.grad for p in t.params if p.grad is not None])
    norm = distributed.full_tensor(norm).to(norm.device)
    torch.nn.utils.clip_grads_with_norm_(t.params, limit, norm)
    grad_norm = float(norm)
    for group in t.optimizer.param_groups:
        group["lr"] = lr
    if t.scaler:
        t.scaler.step(t.optimizer)
        t.scaler.update()
    else:
        t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    return grad_norm


def rank_share(n: int, rank: int, world: int) -> tuple[list[int], int]:
    """Which of a step's `n` micro-batches this rank runs (every world-th), and how many padding
    batches it adds so all ranks run the same number (FSDP's collectives must match)."""
    mine = list(range(rank, n, world))
    return mine, math.ceil(n / world) - len(mine)


def train_step(t: Trainer, pos: Position) -> StepResult:
    """One optimizer step at `pos`; advances `pos`."""
    epoch, first = pos.epoch, pos.batch_index
    indices, ended = take_step_batches(t, pos)
    # Every rank knows the whole step, so the step's token counts need no communication.
    targets = sum(t.items[i].num_targets for idx in indices for i in idx)
    tokens = sum(len(t.items[i].input_ids) for idx in indices for i in idx)
    mine, padding = rank_share(len(indices), distributed.rank(), distributed.world_size())
    chosen = mine + [mine[0] if mine else 0] * padding
    micro_batches = [t.make_batch(indices[k]) for k in chosen]
    seeds = [micro_batch_seed(t.spec.seed, epoch, first + k) for k in chosen]
    lr = lr_at(t.spec, pos.step, t.total_steps)
    local_loss, _ = accumulate_gradients(t, micro_batches, targets, seeds, padding)
    loss = distributed.sum_over_ranks(local_loss)
    grad_norm = optimizer_step(t, lr)
    pos.step += 1
    pos.tokens_seen += tokens
    pos.losses.append(loss)
    return StepResult(loss, grad_norm, tokens, targets, lr, ended)


def train(
    t: Trainer,
    pos: Position,
    on_step: Callable[[StepResult, Position, float], bool | None],
    on_checkpoint: Callable[[Position], None],
    should_stop: Callable[[], bool],
    measure: Callable[[], AbstractContextManager] = nullcontext,
) -> bool:
    """Run optimizer steps until total_steps (returns True) or a stop request (returns False).

    Checkpoints every checkpoint_every_steps steps, at each epoch end, at the end and on stop.
    `on_step` gets the step's wall time and returns True to end training early (early stopping);
    `measure` wraps each step (memory tracking).
    """
    t.model.train()
    every = t.spec.checkpoint_every_steps
    ran = False
    if pos.stopped_early:  # resumed from the checkpoint an early stop left
        return True
    while pos.step < t.total_steps:
        if should_stop():
            if ran:  # else the state is the one resumed from (or the initial one): nothing to save
                on_checkpoint(pos)
            return False
        start = time.perf_counter()
        with measure():
            result = train_step(t, pos)
        seconds = time.perf_counter() - start
        pos.elapsed_s += seconds
        ran = True
        if on_step(result, pos, seconds):
            pos.stopped_early = True
            on_checkpoint(pos)
            return True
        if pos.step >= t.total_steps or result.epoch_ended or (every and pos.step % every == 0):
            on_checkpoint(pos)
    if should_stop():
        on_checkpoint(pos)  # a no-op when the last step was just saved
        return False
    return True
