"""One dpo optimizer step on a global batch of preference pairs (training.step says what steps share)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from training import distributed
from training import step as shared
from training.batches import Step
from training.objectives.dpo.loss import Totals, micro_batch_loss
from training.objectives.dpo.metrics import STAT_NAMES, metrics, note
from training.objectives.dpo.pairs import Pair, Sequences, sequence_indices
from training.step import Batch, Parts, StepResult


def train_step(
    parts: Parts,
    pairs: Sequence[Pair],
    pad_id: int,
    step: Step,
    *,
    lr: float,
    dropout_key: Sequence[int] = (),
) -> StepResult:
    """sft's step on preference pairs: `step` holds pair indices; each micro-batch holds whole pairs; the
    loss is normalised by the step's pairs. Returns the step's mean metrics too (metrics)."""
    spec = parts.spec
    lengths = {i: pairs[i].length for row in step for i in row}
    totals = Totals(len(lengths), sum(pairs[i].chosen.num_targets for i in lengths))
    chosen, padding = shared.rank_micro_batches(spec, lengths, step)
    seqs = Sequences(pairs)
    micro = [sequence_indices(idx) for idx in chosen]
    micro_batches = [shared.make_batch(spec, seqs, idx, pad_id) for idx in micro]
    stats: list[torch.Tensor] = []
    sizes = iter([len(idx) for idx in chosen])

    def loss_fn(batch: Batch) -> torch.Tensor:
        loss, s = micro_batch_loss(parts, batch, next(sizes), totals)
        stats.append(s)
        return loss

    layouts = shared.dropout_layouts(spec, seqs, micro, dropout_key)
    local_loss = shared.accumulate_gradients(parts, micro_batches, loss_fn, padding, layouts)
    real = stats[: len(stats) - padding]
    local = torch.stack(real).sum(0) if real else torch.zeros(len(STAT_NAMES))
    # the step's one read of the device: loss and metric sums together, summed over ranks
    values = distributed.sum_list_over_ranks([float(local_loss), *local.tolist()])
    grad_norm = float(shared.optimizer_step(parts, lr))
    m = metrics(values[1:], totals.pairs)
    targets = sum(pairs[i].num_targets for i in lengths)
    return StepResult(values[0], grad_norm, sum(lengths.values()), targets, lr, fields=m, note=f" {note(m)}")
