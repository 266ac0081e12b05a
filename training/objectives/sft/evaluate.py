"""sft's evaluation on a held-out split: mean token loss and next-token accuracy.

It runs in eval mode under no_grad: dropout is off and no random numbers are drawn, so a run that
evaluates trains exactly like one that does not, and resume stays exact (training.evaluate: when).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from training.data import DatasetError, Tokenized, collate
from training.loss import token_losses


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean cross-entropy per target token
    token_accuracy: float  # share of target tokens whose argmax prediction is right
    target_tokens: int


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
