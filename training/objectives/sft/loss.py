"""sft's loss: a micro-batch's share of the step's token loss, for training.step.accumulate_gradients.

The step's loss is the sum of the token losses (fp32, training.loss: the chunked head) of all its
micro-batches divided by the number of target tokens in all of them (over all ranks). A MoE base whose
config asks for the router's load-balancing loss adds each micro-batch's aux term over its own examples
(training.moe), so that term does not depend on the split either.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from training import moe
from training.loss import token_losses
from training.step import Batch, Parts


class TokenLoss:
    """accumulate_gradients' loss_fn for sft: called once per micro-batch, in order. `total_targets`: the
    step's target tokens over all ranks; `routes`: each micro-batch's examples for the router's aux loss
    (None: no aux loss). Keeps each micro-batch's count of target tokens the argmax predicts (a device
    tensor: the step reads them once, with its loss)."""

    def __init__(self, parts: Parts, total_targets: int, routes: Sequence[moe.Routes] | None = None) -> None:
        self.parts = parts
        self.total_targets = total_targets
        self.routes = iter(routes) if routes else None
        self.hits: list[torch.Tensor] = []

    def __call__(self, batch: Batch) -> torch.Tensor:
        if self.routes is None:
            return self.token_loss_sum(batch) / self.total_targets
        with moe.router_logits(self.parts.model, next(self.routes)) as router:
            loss = self.token_loss_sum(batch) / self.total_targets
        return loss + router.loss(batch["input_ids"].shape[-1])  # type: ignore[union-attr]

    def token_loss_sum(self, batch: Batch) -> torch.Tensor:
        """Sum (not mean) of the next-token cross-entropies of a micro-batch's target tokens, in fp32."""
        p = self.parts
        losses, hits = token_losses(p.model, batch, p.device, p.autocast)
        self.hits.append(hits)
        return losses.sum()

    def correct(self, padding: int = 0) -> torch.Tensor:
        """The target tokens the argmax predicts, over the micro-batches but the last `padding` ones."""
        real = self.hits[: len(self.hits) - padding]
        return torch.stack(real).sum() if real else torch.zeros((), device=self.parts.device)
