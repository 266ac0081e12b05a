"""Mixture-of-experts bases in training: the router's load-balancing loss, the same whatever the split.

transformers adds router_aux_loss_coef x aux to the loss when the config sets output_router_logits, aux
being load_balancing_loss_func (Switch Transformer's): over the rows of a batch and all layers, the share
of top-k picks each expert gets (f_e) times the mean router probability it gets (P_e), summed over
experts, times num_experts. Over a whole micro-batch f and P pool its sequences, so the loss of a step
would depend on how its global batch is split into micro-batches and ranks (and padding would count).
ftune takes the same formula over each example's own tokens (for a micro-batch of one unpadded example it
is transformers' value exactly) and weighs each example by its share of the step's tokens (all ranks):
    loss = cross-entropy sum / step targets + coef x sum over examples s of (tokens_s / step tokens) x aux_s
which is a sum over examples, so accumulation, micro-batch size and FSDP ranks all give the same loss
and gradients, as for the cross-entropy (training.step). The step's logged loss includes the term, as
transformers' does.

The router logits are collected by forward hooks on the router modules (the class transformers records
as router_logits), and the loss is made after the forward, outside any checkpointed region, so that
gradient checkpointing recomputes nothing of it. Which token belongs to which example is worked out on
the host once per micro-batch (Routes), as the dropout masks' layout is (training.dropout). The term is
sft's (training.objectives.sft.loss); dpo's and grpo's losses leave it out, as does the evaluation loss.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from core.spec import JobSpec
from training.data import Tokenized


def _base(model: torch.nn.Module) -> Any:
    return getattr(model, "get_base_model", lambda: model)()  # under peft's wrapper


def aux_loss_coef(model: torch.nn.Module) -> float:
    """The load-balancing loss's weight: the config's router_aux_loss_coef when it sets
    output_router_logits (as transformers decides), else 0 (a dense model too)."""
    config = _base(model).config
    if not getattr(config, "output_router_logits", False) or _router(model) is None:
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def is_moe(model: torch.nn.Module) -> bool:
    return _router(model) is not None


def _router(model: torch.nn.Module) -> tuple[type, int] | None:
    """The router module class and the index of its logits in its output, as transformers records them."""
    recorder = (getattr(type(_base(model)), "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None or getattr(recorder, "target_class", None) is None:
        return None
    return recorder.target_class, int(getattr(recorder, "index", 0) or 0)


@dataclass(frozen=True)
class Routes:
    """A micro-batch's examples: per row, (first token, tokens) of each; and each one's weight, its
    tokens over the step's tokens."""

    rows: tuple[tuple[tuple[int, int], ...], ...]
    weights: tuple[float, ...]

    def flat(self, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(The example of each position of the [rows, width] batch, flattened, -1 for padding; the
        examples' weights; their token counts), made on the host and copied once."""
        sequence = torch.full((len(self.rows) * width,), -1, dtype=torch.long)
        lengths: list[int] = []
        for r, spans in enumerate(self.rows):
            for start, n in spans:
                sequence[r * width + start : r * width + start + n] = len(lengths)
                lengths.append(n)
        weights = torch.tensor(self.weights, dtype=torch.float32)
        counts = torch.tensor(lengths, dtype=torch.float32)
        return _to(sequence, device), _to(weights, device), _to(counts, device)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a host sync (a pageable copy to a GPU waits for it)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def routes(spec: JobSpec, items: Sequence[Tokenized], indices: Sequence[int], step_tokens: int) -> Routes:
    """The Routes of the micro-batch of `indices`, collated as spec.packing says (one packed row, or a
    padded row each)."""
    spans, start = [], 0
    for i in indices:
        n = len(items[i].input_ids)
        spans.append((start if spec.packing else 0, n))
        start += n
    weights = tuple(n / step_tokens for _, n in spans)
    rows = (tuple(spans),) if spec.packing else tuple((s,) for s in spans)
    return Routes(rows, weights)


class RouterLogits:
    """Every layer's router logits of one forward, and the weighted load-balancing loss made of them."""

    def __init__(self, model: torch.nn.Module, routes: Routes | None) -> None:
        config = _base(model).config
        self.coef = aux_loss_coef(model) if routes is not None else 0.0
        self.routes = routes
        self.num_experts = int(getattr(config, "num_experts", 0) or 0)
        self.top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        self.layers: list[torch.Tensor] = []

    def loss(self, width: int) -> torch.Tensor | float:
        """coef x the examples' weighted aux (0 when off); `width`: the batch's row width."""
        layers, self.layers = self.layers, []
        if not self.coef or not layers or self.routes is None:
            return 0.0
        sequence, weights, lengths = self.routes.flat(width, layers[0].device)
        aux = per_example_aux(layers, sequence, lengths, self.num_experts, self.top_k)
        return self.coef * (weights * aux).sum()


def per_example_aux(
    layers: list[torch.Tensor], sequence: torch.Tensor, lengths: torch.Tensor, num_experts: int, top_k: int
) -> torch.Tensor:
    """transformers' load_balancing_loss_func over each example's tokens ([examples]): `layers` the
    router logits [positions, experts] of each layer; `sequence` each position's example (-1: padding)."""
    valid = (sequence >= 0).float()[:, None]
    example = sequence.clamp(min=0)
    shape = (lengths.shape[0], num_experts)
    picks = torch.zeros(shape, device=valid.device)
    probs = torch.zeros(shape, device=valid.device)
    for logits in layers:
        p = torch.softmax(logits.float(), dim=-1)
        chosen = torch.zeros_like(p).scatter_(1, torch.topk(p, top_k, dim=-1).indices, 1.0)
        picks = picks.index_add(0, example, chosen * valid)
        probs = probs.index_add(0, example, p * valid)
    rows = (lengths * len(layers))[:, None]
    return num_experts * ((picks / rows) * (probs / rows)).sum(-1)


@contextmanager
def router_logits(model: torch.nn.Module, routes: Routes | None) -> Iterator[RouterLogits]:
    """Collect the router logits of the forward run inside (when the loss is on: `routes` given and the
    config asks for it); the collector's loss() makes the term afterwards."""
    collector = RouterLogits(model, routes)
    router = _router(model)
    if not collector.coef or router is None:
        yield collector
        return
    cls, index = router

    def keep(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        collector.layers.append(output[index] if isinstance(output, tuple) else output)

    modules = [m for m in _base(model).modules() if isinstance(m, cls) and isinstance(m, torch.nn.Module)]
    handles = [m.register_forward_hook(keep) for m in modules]
    try:
        yield collector
    finally:
        for h in handles:
            h.remove()
