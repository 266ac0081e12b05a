"""The running rows' KV cache: one transformers DynamicCache holding every row, left-padded to the longest.

Why one padded cache rather than a cache per row: a decoding step is one forward over all rows, which
wants their keys and values as one [rows, heads, width, head_dim] tensor per layer; keeping them that way
costs a copy only when a row joins (padding) or leaves (selecting rows), not at every step. Each row's
tokens sit at the right end of the width, so a new token lands in the same column for every row; the
attention mask hides the padding on the left and each row's positions count its own tokens only, so a row
computes what it would alone (up to float rounding of batched matmuls).

A row joins prefilled on its own (a batch of one, no padding: the same forward as a lone request).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def mergeable(cache) -> bool:
    """Whether rows of this cache can be padded and stacked: every layer a plain growing one (full
    attention). Sliding-window or static layers are not (their engine runs one row at a time)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    return isinstance(cache, DynamicCache) and all(type(layer) is DynamicLayer for layer in cache.layers)


class BatchCache:
    def __init__(self) -> None:
        self.cache = None  # the DynamicCache the model reads and grows (None: no rows)
        self.lengths: list[int] = []  # tokens in the cache per row (its own, not the padding)
        self.mask: torch.Tensor | None = None  # [rows, width] 1 where a row has a token

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def join(self, cache, length: int, copies: int = 1) -> None:
        """Add `copies` rows that share one prefilled cache (batch of one, `length` tokens, no padding)."""
        layers = cache.layers
        if copies > 1:
            for layer in layers:
                layer.keys = layer.keys.expand(copies, -1, -1, -1).contiguous()
                layer.values = layer.values.expand(copies, -1, -1, -1).contiguous()
        ones = torch.ones(copies, length, dtype=torch.long, device=layers[0].keys.device)
        if self.cache is None or self.mask is None:
            self.cache, self.mask, self.lengths = cache, ones, [length] * copies
            return
        width = max(self.width, length)
        for mine, new in zip(self.cache.layers, layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, width), _pad_left(new.keys, width)])
            mine.values = torch.cat([_pad_left(mine.values, width), _pad_left(new.values, width)])
        self.mask = torch.cat([F.pad(self.mask, (width - self.width, 0)), F.pad(ones, (width - length, 0))])
        self.lengths += [length] * copies

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only these rows (in this order), and drop the padding columns no row needs any more."""
        if not rows:
            self.cache, self.mask, self.lengths = None, None, []
            return
        assert self.cache is not None and self.mask is not None
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.lengths = [self.lengths[r] for r in rows]
        start = self.width - max(self.lengths)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]
        self.mask = self.mask.index_select(0, index)[:, start:]

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention_mask [rows, width + 1], position_ids [rows, 1]) for one new token per row."""
        assert self.mask is not None
        mask = F.pad(self.mask, (0, 1), value=1)
        positions = torch.tensor(self.lengths, dtype=torch.long, device=mask.device).unsqueeze(1)
        return mask, positions

    def advanced(self, mask: torch.Tensor) -> None:
        """After a step's forward (which grew the cache by one column): `mask` is the one it was given."""
        self.mask = mask
        self.lengths = [n + 1 for n in self.lengths]


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[2] == width else F.pad(t, (0, 0, width - t.shape[2], 0))
