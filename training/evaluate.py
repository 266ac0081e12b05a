"""What every objective's evaluation shares: the held-out split, when to evaluate, and early stopping.

How an objective evaluates is its own (training.objectives: sft's loss and token accuracy, dpo's pair
loss and rewards, grpo's rewards of greedy answers); each runs in eval mode under no_grad, so a run that
evaluates trains exactly like one that does not, and resume stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from core.spec import JobSpec
from training.data import DatasetError
from training.step import Position

# an example (training.data.Tokenized), a preference pair (training.objectives.dpo.pairs.Pair), a prompt
T = TypeVar("T")
VALIDATION_STREAM = 0x5A11D  # a second RNG stream of the seed, apart from the batch order's


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
