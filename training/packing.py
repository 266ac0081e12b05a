"""Padding-free packing: many examples in one flat micro-batch, attention that stays inside each example.

Which examples share a pack is training.batches' (best-fit decreasing within each step's global batch).
A packed micro-batch is a single row of concatenated examples (shape [1, T], T <= micro_batch_size *
max_seq_len: the same token budget, and so the same activation memory, as a padded micro-batch). It
carries no padding at all. Position ids restart at 0 for each example and the first label of every
example is -100, so the last token of one example never learns to predict the next example's first.

Attention runs per example. A dense block-diagonal mask over the whole row would still compute
T x T scores per head and layer (on a CPU that can make packing slower than padding); instead:
- `ftune_packed` (sdpa and eager specs): a function registered with transformers' AttentionInterface
  that splits q/k/v at the example boundaries and runs causal SDPA on each piece, so the work is
  sum(n_i^2), never T^2. Its mask function builds no mask for a packed batch (padded ones fall back
  to SDPA with the usual mask).
- flash_attention_2: transformers' own varlen path, fed the same cu_seq_lens_q/k + max_length_q/k.
The boundaries travel as the standard FlashAttentionKwargs, which every model forwards to its attention.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import pairwise

import torch
import torch.nn.functional as F

from training.data import IGNORE, Tokenized

ATTN_NAME = "ftune_packed"


def collate_packed(items: Iterable[Tokenized]) -> dict[str, torch.Tensor | int]:
    """Concatenate examples into one row: ids, labels (first of each example ignored), position ids
    restarting per example, and the boundaries as cu_seq_lens_q/k (int32) + max_length_q/k."""
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    bounds = [0]
    for t in items:
        n = len(t.input_ids)
        ids.extend(t.input_ids)
        labels.append(IGNORE)
        labels.extend(t.labels[1:])
        positions.extend(range(n))
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = int(cu.diff().max())
    return {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "labels": torch.tensor([labels], dtype=torch.long),
        "position_ids": torch.tensor([positions], dtype=torch.long),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA on each example of each row. q: [B, heads, T, dim]; k, v: [B, kv_heads, T, dim].

    Examples are cut at cu_seq_lens_q (one packed row) or else where position_ids do not step by 1.
    A padded batch (a mask was made, see `_mask`) or a cached one is plain SDPA, so a model loaded for
    packing still works for any batch. Returns [B, T, heads, dim] (the AttentionInterface contract).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None or key.shape[2] != query.shape[2]:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows = []
    bounds = _boundaries(query.shape[0], query.shape[2], cu_seq_lens_q, position_ids)
    # split, not slices: autograd joins the pieces' gradients with one cat, where each slice's
    # backward would write a zero tensor the size of the whole batch. Pieces stay 4-D: SDPA's fused
    # CPU kernel takes only [batch, heads, n, dim] (3-D falls back to the math path, n x n scores kept).
    rows_qkv = zip(query.split(1), key.split(1), value.split(1), bounds, strict=True)
    for q_row, k_row, v_row, row_bounds in rows_qkv:
        sizes = [e - s for s, e in pairwise(row_bounds)]
        pieces = zip(q_row.split(sizes, 2), k_row.split(sizes, 2), v_row.split(sizes, 2), strict=True)
        outs = [
            F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=True
            ).transpose(1, 2)  # [1, n, heads, dim]: the pieces join straight into the output layout
            for q, k, v in pieces
            if q.shape[2]
        ]
        rows.append(outs[0] if len(outs) == 1 else torch.cat(outs, dim=1))
    return (rows[0] if len(rows) == 1 else torch.cat(rows)), None


def _boundaries(
    batch: int, length: int, cu_seq_lens: torch.Tensor | None, position_ids: torch.Tensor | None
) -> list[list[int]]:
    """Per row, the example boundaries [0, ..., length]."""
    if cu_seq_lens is not None:
        if batch != 1:
            raise ValueError(f"cu_seq_lens_q describes one packed row; got a batch of {batch}")
        return [cu_seq_lens.tolist()]
    if position_ids is None:
        return [[0, length]] * batch
    steps = (position_ids[:, 1:] - position_ids[:, :-1]).expand(batch, -1).cpu()
    return [[0, *(torch.nonzero(row != 1).flatten() + 1).tolist(), length] for row in steps]


def _mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The mask function transformers calls for ftune_packed: a padded batch gets SDPA's mask; an
    unpadded or packed one gets none (a dense block mask is exactly the work packing avoids)."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None or bool(attention_mask.all()):
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)  # type: ignore[misc]


def register() -> None:
    """Make `ftune_packed` a valid attn_implementation (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, packed_attention)
    AttentionMaskInterface.register(ATTN_NAME, _mask)


def attn_implementation(attn: str, packing: bool) -> str:
    """The attention a model is loaded with: flash keeps its own varlen path; sdpa and eager become
    per-example SDPA when batches are packed."""
    if not packing or attn == "flash_attention_2":
        return attn
    register()
    return ATTN_NAME
