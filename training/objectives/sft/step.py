"""One sft optimizer step on a global batch of examples (training.step says what all steps share)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from training import distributed, moe
from training import step as shared
from training.batches import Step
from training.data import Tokenized
from training.objectives.sft.loss import TokenLoss
from training.step import Parts, StepResult


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
    (seed, epoch) seeds the examples' dropout masks (training.dropout). Its metric: the token accuracy,
    the share of the step's target tokens whose argmax prediction is the label."""
    spec = parts.spec
    lengths = {i: items[i].length for row in step for i in row}
    # Every rank knows the whole step, so the step's token counts need no communication.
    targets = sum(items[i].num_targets for i in lengths)
    chosen, padding = shared.rank_micro_batches(spec, lengths, step)
    micro_batches = [shared.make_batch(spec, items, idx, pad_id) for idx in chosen]
    routes = None
    if moe.aux_loss_coef(parts.model):  # the router's load-balancing loss, per example (training.moe)
        routes = [moe.routes(spec, items, idx, sum(lengths.values())) for idx in chosen]
    loss_fn = TokenLoss(parts, targets, routes)
    layouts = shared.dropout_layouts(spec, items, chosen, dropout_key)
    local_loss = shared.accumulate_gradients(parts, micro_batches, loss_fn, padding, layouts)
    # the loss and the argmax hits over all micro-batches and ranks: the same whatever the split
    hits = loss_fn.correct(padding)
    sums = distributed.sum_tensor_over_ranks(torch.stack([local_loss.float(), hits.float()]))
    norm = shared.optimizer_step(parts, lr)
    # the step's one host read (each read waits for the device, which then waits for the host)
    loss, right, grad_norm = torch.cat([sums, norm.float().reshape(1).to(sums.device)]).tolist()
    accuracy = right / targets if targets else None
    fields = {"token_accuracy": accuracy}
    return StepResult(loss, grad_norm, sum(lengths.values()), targets, lr, fields=fields)
