"""The rows' KV cache: one transformers cache holding every row, left-padded to the longest.

Why one padded cache rather than a cache per row: a decoding step is one forward over all rows, which
wants their keys and values as one [rows, heads, width, head_dim] tensor per layer; keeping them that way
costs a copy only when a row joins (padding) or leaves (selecting rows), not at every step. Each row's
tokens sit at the right end of the width, so a new token lands in the same column for every row; the
attention mask hides the padding on the left (no mask at all while no row is padded, as generate() does)
and each row's positions count its own tokens only, so a row computes what it would alone (up to float
rounding of batched matmuls).

Rows join prefilled: a lone prompt as a batch of one (no padding: the same forward as a lone request), the
prompts admitted between two steps together, left-padded the same way. A fixed batch (training's) may take
a StaticCache instead, of the whole length at once, as generate(cache_implementation="static") does: on a
GPU transformers then compiles the decoding step (CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

_STATIC_LEN = "_ftune_static_cache_len"  # the longest static cache made for a model (generate()'s rule)


def batchable(config) -> bool:
    """Whether rows of this model's cache can be padded and stacked: every layer of the cache its config
    makes a plain growing one (full attention). Sliding-window layers are not (one row at a time)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)


def static_cache_keeps_dtypes() -> bool:
    """Whether this transformers' static cache holds keys and values each in its own dtype (5.24 on)."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= (5, 24)


def new_cache(model: Any, static_length: int | None = None) -> Any:
    """A DynamicCache for `model` (a transformers model), or a StaticCache of `static_length` columns
    (no shorter than the longest made for this model before, as generate() sizes them: the compiled step
    is not compiled again for a shorter one)."""
    from transformers.cache_utils import DynamicCache, StaticCache

    config = model.config.get_text_config(decoder=True)
    if static_length is None:
        return DynamicCache(config=config)
    if not static_cache_keeps_dtypes():
        raise ValueError(
            "a static cache needs transformers >= 5.24 (its static cache holds keys and values "
            "each in its own dtype, as a Llama under autocast with fp32 weights makes them)"
        )
    length = max(static_length, getattr(model, _STATIC_LEN, -1))
    setattr(model, _STATIC_LEN, length)
    return StaticCache(config=config, max_cache_len=length)


class BatchCache:
    def __init__(self) -> None:
        self.cache: Any = None  # the cache the model reads and grows (None: no rows)
        self.lengths: list[int] = []  # tokens in the cache per row (its own, not the padding)
        self.mask: torch.Tensor | None = None  # [rows, width] 1 where a row has a token

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    @property
    def padded(self) -> bool:
        """Whether a row has padding (else the model needs no attention mask)."""
        return bool(self.lengths) and min(self.lengths) < self.width

    def join(self, cache, mask: torch.Tensor, rows: Sequence[int], lengths: Sequence[int]) -> None:
        """Add rows of a prefilled cache: `mask` [its rows, width] is 1 where a row has a token (left
        padding 0), `rows` the ones to add, in order (a row twice for two choices of one prompt), and
        `lengths` the tokens of each of them."""
        layers = cache.layers
        if list(rows) != list(range(mask.shape[0])):
            index = torch.tensor(rows, dtype=torch.long, device=mask.device)
            mask = mask.index_select(0, index)
            for layer in layers:
                layer.keys, layer.values = (
                    layer.keys.index_select(0, index),
                    layer.values.index_select(0, index),
                )
        start = mask.shape[1] - max(lengths)  # padding columns no added row needs
        if start:
            mask = mask[:, start:]
            for layer in layers:
                layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]
        if self.cache is None or self.mask is None:
            self.cache, self.mask, self.lengths = cache, mask, list(lengths)
            return
        width = max(self.width, mask.shape[1])
        for mine, new in zip(self.cache.layers, layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, width), _pad_left(new.keys, width)])
            mine.values = torch.cat([_pad_left(mine.values, width), _pad_left(new.values, width)])
        self.mask = torch.cat(
            [F.pad(self.mask, (width - self.width, 0)), F.pad(mask, (width - mask.shape[1], 0))]
        )
        self.lengths += lengths

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
