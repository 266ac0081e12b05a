"""The LoRA dropout masks before they were hashed: a torch.Generator, a rand and a masked_fill per example
and module (training.dropout until the hashed masks), kept verbatim as the benches' baseline."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from training import dropout


def per_example_forward(self: dropout.ExampleDropout, x: torch.Tensor) -> torch.Tensor:
    if not self.training or self.p == 0:
        return x
    if self.layout is None:
        return F.dropout(x, self.p, training=True)
    scale = 1.0 / (1.0 - self.p)
    if x.device.type == "cuda":
        return dropout._Masked.apply(x, per_example_mask(self, x, self.layout, torch.bool, True), scale)
    return x * per_example_mask(self, x, self.layout, x.dtype, scale)


def per_example_mask(
    self: dropout.ExampleDropout,
    x: torch.Tensor,
    layout: dropout.Layout,
    dtype: torch.dtype,
    kept: float | bool,
) -> torch.Tensor:
    mask = torch.full(x.shape, kept, dtype=dtype, device=x.device)
    for r, spans in enumerate(layout.rows):
        for start, n, seed in spans:
            g = torch.Generator(device=x.device).manual_seed(seed ^ self.salt)
            dropped = torch.rand((n, x.shape[2]), generator=g, device=x.device) < self.p
            mask[r, start : start + n].masked_fill_(dropped, 0)
    return mask


@contextmanager
def masks(kind: str) -> Iterator[None]:
    """Run with the old masks ("per-example") or the current ones ("hashed")."""
    current = dropout.ExampleDropout.forward
    if kind == "per-example":
        dropout.ExampleDropout.forward = per_example_forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        dropout.ExampleDropout.forward = current  # type: ignore[method-assign]
