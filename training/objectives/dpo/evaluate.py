"""dpo's evaluation on held-out pairs: the step's loss and metrics, in eval mode (no dropout)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from training.objectives.dpo.loss import Totals, micro_batch_loss
from training.objectives.dpo.metrics import STAT_NAMES, metrics
from training.objectives.dpo.pairs import Pair, Sequences, sequence_indices
from training.step import Parts, make_batch


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean DPO loss per pair (+ rpo_alpha x the chosen NLL per token)
    metrics: dict[str, float]
    pairs: int


@torch.no_grad()
def evaluate(parts: Parts, pairs: Sequence[Pair], pad_id: int, batch_pairs: int) -> EvalResult:
    """The step's loss and metrics over `pairs`, in eval mode (no dropout), batch_pairs pairs a batch."""
    model = parts.model
    was_training = model.training
    model.eval()
    totals = Totals(len(pairs), sum(p.chosen.num_targets for p in pairs))
    seqs = Sequences(pairs)
    spec = parts.spec.model_copy(update={"packing": False})  # padded batches, as sft evaluates
    loss, sums = 0.0, torch.zeros(len(STAT_NAMES))
    order = sorted(range(len(pairs)), key=lambda i: pairs[i].length)
    try:
        for start in range(0, len(order), batch_pairs):
            idx = order[start : start + batch_pairs]
            batch = make_batch(spec, seqs, sequence_indices(idx), pad_id)
            part, s = micro_batch_loss(parts, batch, len(idx), totals)
            loss += float(part)
            sums += s.cpu()
    finally:
        model.train(was_training)
    return EvalResult(loss, metrics(sums.tolist(), len(pairs)), len(pairs))
