"""Evaluation on a held-out split (mean token loss, next-token accuracy) and early stopping.

Evaluation runs in eval mode under no_grad: dropout is off and no random numbers are drawn, so a run
that evaluates trains exactly like one that does not, and resume stays exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from core.spec import JobSpec
from training.data import DatasetError, Tokenized, collate
from training.loss import token_losses
from training.step import Position

T = TypeVar("T")  # an example (training.data.Tokenized) or a preference pair (training.preference.Pair)
VALIDATION_STREAM = 0x5A11D  # a second RNG stream of the seed, apart from the batch order's


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean cross-entropy per target token
    token_accuracy: float  # share of target tokens whose argmax prediction is right
    target_tokens: int


def split_validation(items: Sequence[T], fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """(train, validation): a seeded `fraction` of the examples held out, at least one when > 0."""
    if not fraction:
        return list(items), []
    n_val = max(1, round(len(items) * fraction))
    if n_val >= len(items):
        raise DatasetError(f"validation_fraction {fraction} leaves no example to train on")
    held = set(np.random.default_rng([seed, VALIDATION_STREAM]).permutation(len(items))[:n_val].tolist())
    train = [x for i, x in enumerate(items) if i not in held]
    return train, [items[i] for i in sorted(held)]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    items: Sequence[Tokenized],
    batch_size: int,
    pad_id: int,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager],
) -> EvalResult:
    """Loss and accuracy over every target token of `items` (batched by length: little padding)."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.long, device=device)
    targets = 0
    order = sorted(range(len(items)), key=lambda i: len(items[i].input_ids))
    try:
        for start in range(0, len(order), batch_size):
            batch = collate([items[i] for i in order[start : start + batch_size]], pad_id)
            losses, hits = token_losses(model, batch, device, autocast)
            loss_sum += losses.sum()  # on the device: read once, after the last batch
            correct += hits
            targets += len(losses)
    finally:
        model.train(was_training)
    if targets == 0:
        raise DatasetError("the validation split has no tokens to evaluate on")
    return EvalResult(float(loss_sum) / targets, int(correct) / targets, targets)


def is_eval_step(spec: JobSpec, step: int, total_steps: int, epoch_ended: bool) -> bool:
    """Evaluate every eval_every_steps steps, else at each epoch end; always after the last step."""
    every = spec.eval_every_steps
    return step >= total_steps or (step % every == 0 if every else epoch_ended)


def record_eval(pos: Position, loss: float, min_delta: float) -> None:
    """Track the best eval loss and how many evaluations have passed without beating it."""
    if pos.best_eval_loss is None or loss < pos.best_eval_loss - min_delta:
        pos.best_eval_loss = loss
        pos.evals_without_improvement = 0
    else:
        pos.evals_without_improvement += 1


def should_stop_early(spec: JobSpec, pos: Position) -> bool:
    patience = spec.early_stopping_patience
    return patience is not None and pos.evals_without_improvement >= patience
