"""LoRA dropout whose masks do not depend on how a step is split into micro-batches and ranks.

peft's LoRA dropout (nn.Dropout) draws one mask over the whole micro-batch from the global RNG, so the
mask an example gets depends on which micro-batch, row and rank it lands in: micro 4 x accumulation 1
and micro 1 x accumulation 4 would train differently. Here each LoRA dropout is an ExampleDropout whose
mask is a counter-based hash: whether feature f of the j-th token of an example is dropped in module m
is a pure function of (the example's seed, which names (seed, epoch, example), j, m, f), put where the
example sits in the micro-batch (its padded row, or its span of a packed row). So every split draws the
same mask for the same token, a resume draws it again, and gradient checkpointing's recomputation draws
the same one (nothing comes from the global RNG).

Being a hash of indices, the whole micro-batch's mask is made at once with integer tensor ops on the
input's device: no loop over examples and no generator per example in the forward, no host sync. The
tokens' keys are made on the host once per micro-batch (numpy) and copied over once; every module then
runs the same few elementwise kernels, in chunks whose two int64 temporaries take no more than the input
(the transient the planner counts for a LoRA input's copy): 4 (fp32) or 8 (bf16) chunks, CHUNK at most.

The step places each micro-batch's Layout on the model (`placed`) around its forward and backward.
Without one (a forward outside a training step) the module is plain dropout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from core.spec import JobSpec
from training.data import Tokenized

Span = tuple[int, int, int]  # (first token in the row, tokens, the example's seed)

CHUNK = 1 << 24  # elements hashed at once at most: two int64 temporaries of 128 MiB
_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # the 32-bit integer hash's multiplier (< 2**27: x * _MUL of a 32-bit x fits int64 exactly)
_FEATURES: dict[tuple[torch.device, int], torch.Tensor] = {}  # feature keys by (device, features)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 (numpy wraps around, as the hash needs)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _key32(values: np.ndarray) -> np.ndarray:
    """Independent-looking 32-bit keys of distinct uint64 values, as int64 (torch has no uint32 maths)."""
    return (_mix64(values) >> np.uint64(32)).astype(np.int64)


@dataclass(frozen=True)
class Layout:
    """Where a micro-batch's examples sit: per row, the spans of its examples."""

    rows: tuple[tuple[Span, ...], ...]
    # the tokens' keys on a device, made by the first module that needs them: (device, width, p) -> tensors
    _tokens: dict[Any, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def tokens(self, device: torch.device, width: int, p: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token of the [rows, width] input: its key (a hash of the example's seed and the token's
        position in the example) and its threshold (a feature whose hash is below it is dropped; 0 for
        padding, which reaches no target). Made once per micro-batch, not once per module."""
        if (device, width, p) not in self._tokens:
            spans = np.array([(r, *span) for r, row in enumerate(self.rows) for span in row], np.uint64)
            spans = spans.reshape(-1, 4)  # (row, start, tokens, seed) per example
            n = spans[:, 2].astype(np.int64)
            if len(spans) and int((spans[:, 1] + spans[:, 2]).max()) > width:
                raise RuntimeError(f"a dropout layout longer than the input's {width} tokens")
            first = np.repeat(np.cumsum(n) - n, n)  # each token's example's first token, in `j`'s count
            j = (np.arange(int(n.sum())) - first).astype(np.uint64)  # position in the example
            row, col = np.repeat(spans[:, 0], n).astype(np.int64), np.repeat(spans[:, 1], n) + j
            seed = np.repeat(spans[:, 3], n)
            keys = np.zeros((len(self.rows), width), np.int64)
            thresholds = np.zeros((len(self.rows), width), np.int64)
            keys[row, col.astype(np.int64)] = _key32(seed ^ _mix64(j + np.uint64(0x9E3779B97F4A7C15)))
            thresholds[row, col.astype(np.int64)] = round(p * 2**32)
            pair = (_to(torch.from_numpy(keys), device), _to(torch.from_numpy(thresholds), device))
            self._tokens[(device, width, p)] = pair
        return self._tokens[(device, width, p)]


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a host sync (a pageable copy to a GPU waits for it)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _features(device: torch.device, n: int) -> torch.Tensor:
    if (device, n) not in _FEATURES:
        keys = _key32(np.arange(n, dtype=np.uint64) + np.uint64(0xD1B54A32D192ED03))
        _FEATURES[(device, n)] = _to(torch.from_numpy(keys), device)
    return _FEATURES[(device, n)]


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


def keep_mask(
    tokens: torch.Tensor, thresholds: torch.Tensor, features: torch.Tensor, module: int, budget: int
) -> torch.Tensor:
    """[rows, T, features] bool: True where kept. The hash of (token key ^ module key ^ feature key) is
    Thomas Mueller's 32-bit integer hash without its last xorshift (the comparison reads the high bits,
    which the multiplication has mixed); every value stays below 2**63, so int64 maths is exact and the
    same on every device. Dropped where the hash is below the token's threshold: probability p. `budget`:
    bytes the int64 temporaries may take (one token's at least)."""
    flat_t = (tokens ^ module).reshape(-1, 1)
    flat_thr = thresholds.reshape(-1, 1)
    keep = torch.empty((flat_t.shape[0], features.shape[0]), dtype=torch.bool, device=tokens.device)
    step = max(1, min(CHUNK, budget // 16) // features.shape[0])  # 16 bytes: two int64s
    for a in range(0, flat_t.shape[0], step):
        h = flat_t[a : a + step] ^ features
        h ^= h >> 16
        h.mul_(_MUL).bitwise_and_(_M32)
        h ^= h >> 16
        h.mul_(_MUL).bitwise_and_(_M32)
        torch.ge(h, flat_thr[a : a + step], out=keep[a : a + step])
    return keep.view(*tokens.shape, features.shape[0])


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
        self.salt = index * 0x9E3779B97F4A7C15 % 2**63
        self.key = int(_key32(np.array([self.salt], np.uint64))[0])  # this module's own masks
        self.layout: Layout | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.layout is None:
            return F.dropout(x, self.p, training=True)
        scale = 1.0 / (1.0 - self.p)
        keep = self._mask(x, self.layout)
        if x.device.type == "cuda":
            return _Masked.apply(x, keep, scale)
        return x * keep.to(x.dtype).mul_(scale)

    def _mask(self, x: torch.Tensor, layout: Layout) -> torch.Tensor:
        """True where a token's feature is kept; padding is kept (it reaches no target)."""
        if x.dim() != 3 or x.shape[0] != len(layout.rows):
            raise RuntimeError(
                f"a dropout layout of {len(layout.rows)} rows for an input of {tuple(x.shape)}"
            )
        tokens, thresholds = layout.tokens(x.device, x.shape[1], self.p)
        features = _features(x.device, x.shape[2])
        return keep_mask(tokens, thresholds, features, self.key, x.numel() * x.element_size())

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
