"""LoRA dropout whose masks do not depend on how a step is split into micro-batches and ranks.

peft's LoRA dropout (nn.Dropout) draws one mask over the whole micro-batch from the global RNG, so the
mask an example gets depends on which micro-batch, row and rank it lands in: micro 4 x accumulation 1
and micro 1 x accumulation 4 would train differently. Here each LoRA dropout is an ExampleDropout: the
mask of an example's tokens is drawn from a generator seeded by (seed, epoch, the example, the module)
and put where the example sits in the micro-batch (its padded row, or its span of a packed row). So
every split draws the same mask for the same token, a resume draws it again, and gradient
checkpointing's recomputation draws the same one (nothing comes from the global RNG).

The step places each micro-batch's Layout on the model (`placed`) around its forward and backward.
Without one (a forward outside a training step) the module is plain dropout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from core.spec import JobSpec
from training.data import Tokenized

Span = tuple[int, int, int]  # (first token in the row, tokens, the example's seed)


@dataclass(frozen=True)
class Layout:
    """Where a micro-batch's examples sit: per row, the spans of its examples."""

    rows: tuple[tuple[Span, ...], ...]


def example_seed(key: Sequence[int], index: int) -> int:
    return int(np.random.SeedSequence([*key, index]).generate_state(1, np.uint64)[0] >> 1)


def layout(spec: JobSpec, items: Sequence[Tokenized], indices: Sequence[int], key: Sequence[int]) -> Layout:
    """The layout of the micro-batch of `indices` (collated as spec.packing says); `key` (seed, epoch)
    names the epoch, in which each example is trained once."""
    spans = []
    start = 0
    for i in indices:
        n = len(items[i].input_ids)
        spans.append((start, n, example_seed(key, i)))
        start += n if spec.packing else 0
    if spec.packing:
        return Layout((tuple(spans),))  # one row, examples one after another
    return Layout(tuple((s,) for s in spans))  # a row each, padding after


class _Masked(torch.autograd.Function):
    """x * keep * scale, saving the boolean mask only (as torch's fused CUDA dropout does)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.mul(x, keep).mul_(scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (keep,) = ctx.saved_tensors
        return torch.mul(grad, keep).mul_(ctx.scale), None, None


class ExampleDropout(torch.nn.Module):
    """Keeps for backward what torch's dropout keeps (the planner counts that): a bool mask on a GPU,
    the scaled mask in the input's dtype on a CPU."""

    def __init__(self, p: float, index: int) -> None:
        super().__init__()
        self.p, self.index = p, index
        self.salt = index * 0x9E3779B97F4A7C15 % 2**63  # this module's own stream of every example's seed
        self.layout: Layout | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.layout is None:
            return F.dropout(x, self.p, training=True)
        scale = 1.0 / (1.0 - self.p)
        if x.device.type == "cuda":
            return _Masked.apply(x, self._mask(x, self.layout, torch.bool, True), scale)
        return x * self._mask(x, self.layout, x.dtype, scale)

    def _mask(self, x: torch.Tensor, layout: Layout, dtype: torch.dtype, kept: float | bool) -> torch.Tensor:
        """`kept` where a token's feature is kept, 0 where dropped; padding is kept (it reaches no target)."""
        if x.dim() != 3 or x.shape[0] != len(layout.rows):
            raise RuntimeError(
                f"a dropout layout of {len(layout.rows)} rows for an input of {tuple(x.shape)}"
            )
        mask = torch.full(x.shape, kept, dtype=dtype, device=x.device)
        for r, spans in enumerate(layout.rows):
            for start, n, seed in spans:
                g = torch.Generator(device=x.device).manual_seed(seed ^ self.salt)
                dropped = torch.rand((n, x.shape[2]), generator=g, device=x.device) < self.p
                mask[r, start : start + n].masked_fill_(dropped, 0)
        return mask

    def extra_repr(self) -> str:
        return f"p={self.p}, index={self.index}"


def install(model: torch.nn.Module) -> int:
    """Replace peft's LoRA dropouts with ExampleDropouts, numbered in module order (the same on every
    rank and every run). Returns how many were replaced."""
    n = 0
    for module in model.modules():
        table = getattr(module, "lora_dropout", None)
        if not isinstance(table, torch.nn.ModuleDict):
            continue
        for name, d in list(table.items()):
            if isinstance(d, torch.nn.Dropout) and d.p > 0:
                table[name] = ExampleDropout(d.p, n)
                n += 1
    return n


@contextmanager
def placed(model: torch.nn.Module, where: Layout | None) -> Iterator[None]:
    """Run a micro-batch's forward and backward with its layout on every ExampleDropout."""
    modules = [m for m in model.modules() if isinstance(m, ExampleDropout)]
    for m in modules:
        m.layout = where
    try:
        yield
    finally:
        for m in modules:
            m.layout = None
