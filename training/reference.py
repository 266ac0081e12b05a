"""The reference policy: the model the adapter starts from, run on the policy's own weights.

dpo's losses (training.objectives.dpo) and grpo's KL term (training.objectives.grpo) compare the policy
with it, and never hold a second copy of the base:
- a fresh adapter: the base alone, peft's disable_adapter() for the reference forward;
- a job continuing from an earlier adapter (spec.init_from): that adapter loaded twice on the one base,
  "default" (trained) and REF_ADAPTER (frozen, no dropout); the reference forward switches every LoRA
  layer to REF_ADAPTER (training.model.attach_trained_lora builds both).
An objective runs it in every micro-batch, under no_grad, before the policy's forward (so no activation
of either is kept while the other runs), on the same batch: not precomputed. Why: the reference is then
a pure function of frozen weights and the batch, so resume, accumulation and FSDP need nothing more (no
stored log-probs to checkpoint, shard or keep in step with the batch order), and the numbers are TRL's
own (its default, precompute_ref_log_probs=False). Its cost is one forward without backward per micro-
batch (about a third of a step without checkpointing); precomputing would save that only from the
second epoch on, and DPO runs are usually one epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

REF_ADAPTER = "ref"


@contextmanager
def reference_policy(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` as the reference: the REF_ADAPTER adapter where there is one, else the base alone."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not any(REF_ADAPTER in getattr(m, "lora_A", {}) for m in layers):
        with model.disable_adapter():  # type: ignore[operator]
            yield
        return
    # Switch the layers only: peft's set_adapter would also flip requires_grad on the adapters.
    saved = [m._active_adapter for m in layers]
    try:
        for m in layers:
            m._active_adapter = [REF_ADAPTER]
        yield
    finally:
        for m, active in zip(layers, saved, strict=True):
            m._active_adapter = active
