"""Attention for ftune's own batches: packed rows without padding, right-padded rows without a mask.

Which examples share a pack is training.batches' (best-fit decreasing within each step's global batch).
A packed micro-batch is a single row of concatenated examples (shape [1, T], T <= micro_batch_size *
max_seq_len: the same token budget, and so the same activation memory, as a padded micro-batch). It
carries no padding at all. Position ids restart at 0 for each example and the first label of every
example is -100, so the last token of one example never learns to predict the next example's first.

The row's example boundaries (cu_seq_lens_q/k, int32, and max_length_q/k) are made once per batch at
collation, on the host, and travel as the standard FlashAttentionKwargs, which every transformers model
forwards to its attention. `ftune_packed`, registered with transformers' AttentionInterface, reads them:
- CUDA, half precision: one varlen flash-attention call per layer for the whole row (PyTorch's own
  torch.nn.attention.varlen), no host sync; the score work is sum(n_i^2), never T^2.
- otherwise (a CPU): causal SDPA on each example (the bounds are host tensors there, so cutting costs no
  sync); a dense block mask would compute T x T scores, slower on a CPU than the per-example calls.
- flash_attention_2 (flash-attn installed): transformers' own varlen path, fed the same kwargs.
A batch without bounds is one sequence per row, right-padded at most: plain causal SDPA with no mask, as
no real token attends to a later position, so padding is never seen (its labels are -100). That is why
no mask function is registered: transformers then builds no mask and makes no host sync for one, and
SDPA takes its flash kernel on CUDA. (Left padding is never made by ftune's collation.) Generation is
another matter: a batch of left-padded prompts, and a cache longer than what it holds, need transformers'
padding mask, so rollouts generate under `masked_attention` (SDPA with its masks for that while).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F

from training.data import IGNORE, Tokenized, extra_inputs, scored_targets

ATTN_NAME = "ftune_packed"
log = logging.getLogger("ftune.training")


def collate_packed(items: Sequence[Tokenized]) -> dict[str, torch.Tensor | int]:
    """Concatenate examples into one row: ids, labels (first of each example ignored), position ids
    restarting per example, the boundaries as cu_seq_lens_q/k (int32) + max_length_q/k, and the loss's
    targets (training.data.scored_targets)."""
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
    lengths = cu.diff()
    label_row = torch.tensor([labels], dtype=torch.long)
    return {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "labels": label_row,
        "position_ids": torch.tensor([positions], dtype=torch.long),
        **extra_inputs(items, None),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": int(lengths.max()),
        "max_length_k": int(lengths.max()),
        **scored_targets(label_row, torch.arange(len(lengths)).repeat_interleave(lengths)),
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
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each example of a packed row. q: [1, heads, T, dim]; k, v: [1, kv_heads,
    T, dim]. Without bounds (cu_seq_lens_q), or with a cache or a mask, plain SDPA. Returns [B, T, heads,
    dim] (the AttentionInterface contract)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None or attention_mask is not None or key.shape[2] != query.shape[2]:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"cu_seq_lens_q describes one packed row; got a batch of {query.shape[0]}")
    kernel = varlen_kernel(query) if dropout == 0.0 else None
    if kernel is not None and max_length_q is not None:
        return kernel(query, key, value, cu_seq_lens_q, max_length_q, scaling), None
    return per_example_attention(query, key, value, cu_seq_lens_q, dropout, scaling), None


def per_example_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    dropout: float = 0.0,
    scaling: float | None = None,
) -> torch.Tensor:
    """Causal SDPA on each example of one packed row (the exact path on a CPU). [1, T, heads, dim]."""
    # One read of the bounds: free for a host tensor (a CPU), one sync on a device.
    sizes = [e - s for s, e in pairwise(cu_seq_lens.tolist())]
    # split, not slices: autograd joins the pieces' gradients with one cat, where each slice's
    # backward would write a zero tensor the size of the whole batch. Pieces stay 4-D: SDPA's fused
    # CPU kernel takes only [batch, heads, n, dim] (3-D falls back to the math path, n x n scores kept).
    pieces = zip(query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2), strict=True)
    outs = [
        F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=True
        ).transpose(1, 2)  # [1, n, heads, dim]: the pieces join straight into the output layout
        for q, k, v in pieces
        if q.shape[2]
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float | None], torch.Tensor]


def varlen_kernel(query: torch.Tensor) -> Kernel | None:
    """PyTorch's varlen flash attention for this query, if this torch has one that trains (CUDA, fp16 or
    bf16, or fp32 under autocast, which SDPA would run in the autocast dtype too); None otherwise (the
    caller takes the per-example path)."""
    if not query.is_cuda:
        return None
    dtype = query.dtype
    if dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")  # fp32 weights: RoPE's fp32 cos/sin made q and k fp32
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    kernel = _checked_varlen(query.device.index or 0, dtype)
    if kernel is None or dtype == query.dtype:
        return kernel
    return lambda q, k, v, cu, longest, scale: kernel(
        q.to(dtype), k.to(dtype), v.to(dtype), cu, longest, scale
    )


# _checked_varlen's kernels by (device, dtype): a dict, not functools.cache, which torch.compile traces
# through (a compiled decoder layer would run the check again in every call); prepare() runs the check
# at load time, before any compiled call
_varlen_kernels: dict[tuple[int, torch.dtype], Kernel | None] = {}


def _checked_varlen(device_index: int, dtype: torch.dtype) -> Kernel | None:
    """The varlen kernel once it has run forward and backward here on a small packed row and matched
    per-example SDPA: its signature moved between torch releases and its backward is new, so it is
    proven on this device and dtype once per process instead of assumed."""
    key = (device_index, dtype)
    if key not in _varlen_kernels:
        _varlen_kernels[key] = _proven_varlen(device_index, dtype)
    return _varlen_kernels[key]


def _proven_varlen(device_index: int, dtype: torch.dtype) -> Kernel | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        log.warning(
            "packed attention: this torch has no torch.nn.attention.varlen; one SDPA call per example"
        )
        return None
    kernel = _varlen_call(varlen_attn)  # type: ignore[arg-type]  # returns a tuple only when asked
    try:
        # Its own little graph, even when first asked inside a model's forward: with grad, no autocast, and
        # none of its saved tensors packed by an enclosing activation checkpoint (which would then count a
        # different number of saved tensors when it recomputes the layer).
        with (
            torch.enable_grad(),
            torch.autocast("cuda", enabled=False),
            torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x),
        ):
            _check(kernel, torch.device("cuda", device_index), dtype)
    except Exception as exc:  # any failure: the exact per-example path, said once
        log.warning(
            "packed attention: varlen attention failed its check (%s); one SDPA call per example", exc
        )
        return None
    log.info("packed attention: torch varlen flash attention, one call per layer")
    return kernel


def _varlen_call(varlen_attn: Callable[..., torch.Tensor]) -> Kernel:
    """Adapt transformers' [1, heads, T, dim] layout and this torch's varlen signature (causality was an
    is_causal flag, later a (-1, 0) window; GQA an enable_gqa flag)."""
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = "enable_gqa" in params

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scale):
        # [T, heads, dim]: the projections' own layout, so contiguous() copies nothing there
        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))
        extra: dict[str, object] = dict(causal)
        if q.shape[1] != k.shape[1]:
            if gqa:
                extra["enable_gqa"] = True
            else:
                k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        if scale is not None and "scale" in params:
            extra["scale"] = scale
        elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
            raise ValueError("this torch's varlen attention takes no scale")
        out = varlen_attn(q, k, v, cu, cu, longest, longest, **extra)
        return out.unsqueeze(0)  # [1, T, heads, dim]

    return call


def _check(kernel: Kernel, device: torch.device, dtype: torch.dtype) -> None:
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, h, 19, 64, device=device, dtype=dtype, generator=g).requires_grad_() for h in (4, 2, 2)
    )
    cu = torch.tensor([0, 7, 8, 19], dtype=torch.int32, device=device)
    got = kernel(q, k, v, cu, 11, None)
    got.float().square().sum().backward()
    grads = [x.grad for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    want = per_example_attention(q, k, v, cu.cpu())
    want.float().square().sum().backward()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    for a, b in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


def prepare(device: torch.device) -> None:
    """Run the varlen kernel's one check at load time, not inside the first forward."""
    if device.type == "cuda":
        half = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        _checked_varlen(device.index or 0, half)


def register() -> None:
    """Make `ftune_packed` a valid attn_implementation (idempotent). No mask function: see the module doc."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, packed_attention)


@contextmanager
def masked_attention(model: Any) -> Iterator[None]:
    """transformers' SDPA, masks and all, for a model loaded with ftune_packed (peft's wrapper or not),
    until the block ends: generate() pads prompts on the left, which ftune_packed, given no mask, would
    attend to. Any other attention is left as it is."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "_attn_implementation", None) != ATTN_NAME:
        yield
        return
    base.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        base.set_attn_implementation(ATTN_NAME)


def attn_implementation(attn: str, packing: bool) -> str:
    """The attention a model is loaded with: flash keeps its own varlen path; sdpa becomes ftune's (the
    same SDPA for unpacked batches, without a mask), and eager too when batches are packed."""
    if attn == "flash_attention_2" or (attn == "eager" and not packing):
        return attn
    register()
    return ATTN_NAME
