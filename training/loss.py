"""The causal-LM loss head: each scored token's cross-entropy, without [tokens, vocab] logits in memory.

The model runs as usual (its lm_head on one position only, a negligible [batch, 1, vocab]); the decoder's
final hidden states are taken at the scored positions (training.data.scored_targets, made on the host),
and the head runs on those alone, in chunks of planner.memory.loss_chunk_tokens(vocab) tokens. For
each chunk one autograd-free pass makes the logits (the compute dtype, as autocast makes them), the
fp32 loss, the argmax hits, and the gradient of each token's loss with respect to its hidden state
((softmax - one-hot) @ W): a token's loss depends on its own hidden state alone, so backward only scales
those rows by the incoming gradient. Peak memory of the head: one chunk's vocab-sized buffers plus
[scored tokens, hidden], instead of [scored tokens, vocab] x 12 bytes (the largest tensors of a step for
150k-256k vocabularies).

The plain path (logits of all scored tokens, fp32 cross-entropy) serves what the fused one cannot: an
lm_head that trains or is not a plain Linear (LoRA on lm_head), logit soft-capping or scaling, and it is
the reference the fused path is tested against.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from planner.memory import loss_chunk_tokens
from training import distributed

# What a collated batch holds for the loss (training.data.scored_targets), not for the model.
TARGET_KEYS = ("labels", "target_index", "target_labels", "target_sequence")


def token_losses(
    model: torch.nn.Module,
    batch: Mapping[str, torch.Tensor | int],
    device: torch.device,
    autocast: Callable[[], AbstractContextManager[object]] = nullcontext,
    fused: bool = True,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 cross-entropy of each scored token of the batch, in target_index order; how many of them the
    argmax predicts, a device tensor). `fused`: the chunked head where the model allows it.
    `temperature`: of logits / temperature (grpo scores its samples at their sampling temperature)."""
    inputs = {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
        if k not in TARGET_KEYS
    }
    index = batch["target_index"].to(device, non_blocking=True)  # type: ignore[union-attr]
    wanted = batch["target_labels"].to(device, non_blocking=True)  # type: ignore[union-attr]
    base = getattr(model, "get_base_model", lambda: model)()  # under peft's wrapper
    with autocast(), final_hidden_states(base) as hidden:
        model(**inputs, logits_to_keep=1)
        h = hidden.pop().flatten(0, 1).index_select(0, index)
        return head_losses(base, h, wanted, fused, temperature)


@contextmanager
def final_hidden_states(base: Any) -> Iterator[list[torch.Tensor]]:
    """Collects the decoder's last_hidden_state (after the final norm) of each forward inside."""
    decoder: torch.nn.Module = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    captured: list[torch.Tensor] = []

    def keep(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = decoder.register_forward_hook(keep)
    try:
        yield captured
    finally:
        handle.remove()


def head_losses(
    base: Any, h: torch.Tensor, wanted: torch.Tensor, fused: bool = True, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lm_head and cross-entropy on hidden states h [N, hidden] for target tokens `wanted` [N], of
    the logits divided by `temperature`."""
    head = base.get_output_embeddings()
    config = base.config
    scale = getattr(config, "logit_scale", None)
    cap = getattr(config, "final_logit_softcapping", None)
    plain_only = (
        not isinstance(head, torch.nn.Linear)
        or any(p.requires_grad for p in head.parameters())
        or scale not in (None, 1, 1.0)
        or cap is not None
        or (temperature != 1.0 and head.bias is not None)  # the fused path scales h, not the bias
    )
    if not fused or plain_only:
        logits = head(h)
        if scale not in (None, 1, 1.0):
            logits = logits * scale
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        logits = logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        hits = (logits.argmax(-1) == wanted).sum()
        return F.cross_entropy(logits, wanted, reduction="none"), hits
    # Frozen: under FSDP gathered already once its root has run; a still-sharded one is gathered here (a
    # collective every rank reaches in step).
    weight = distributed.whole(head.weight)
    bias = distributed.whole(head.bias) if head.bias is not None else None
    if temperature != 1.0:
        h = h / temperature  # (h / t) @ W.T = logits / t without a bias
    losses, hits = _LinearCrossEntropy.apply(h, weight, bias, wanted, loss_chunk_tokens(weight.shape[0]))
    return losses, hits


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of (h @ W.T + b) without keeping the logits (see the module doc)."""

    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        wanted: torch.Tensor,
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        need_grad = ctx.needs_input_grad[0]
        losses = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_grad else None
        hits = torch.zeros((), dtype=torch.long, device=h.device)
        for start in range(0, h.shape[0], chunk):
            end = min(start + chunk, h.shape[0])
            target = wanted[start:end]
            logits = F.linear(h[start:end], weight, bias).float()  # the compute dtype's logits, in fp32
            hits += (logits.argmax(-1) == target).sum()
            lse = logits.logsumexp(-1)
            losses[start:end] = lse - logits.gather(1, target[:, None]).squeeze(1)
            if grad_h is not None:
                probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place
                probs[torch.arange(end - start, device=h.device), target] -= 1.0
                grad_h[start:end] = probs.to(weight.dtype) @ weight  # the autocast dtype's matmul
        ctx.save_for_backward(grad_h)
        ctx.mark_non_differentiable(hits)
        return losses, hits

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor, _hits: torch.Tensor) -> tuple[Any, ...]:
        (grad_h,) = ctx.saved_tensors
        return grad_h * grad_losses[:, None].to(grad_h.dtype), None, None, None, None
