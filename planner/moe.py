"""What a mixture-of-experts block adds to the memory model (core.arch.experts), beside its weights.

transformers 5 runs a sparse block as: the router's logits [tokens, experts] and their fp32 softmax (kept
for backward), the top_k experts of each token (int64 ids), then the experts over the micro-batch's
tokens x top_k (token, expert) rows sorted by expert, with one grouped matmul per stack
(transformers.integrations.moe.grouped_mm_experts_forward; no capacity factor and no dropped tokens, so the
rows are tokens x top_k whatever the balance of a packed batch). Per token it keeps (checked on CPU with
saved-tensor hooks on a Qwen3-MoE block):
  - gate_up's output (2 x expert width) and act(gate) (1 x) per routed row: 3 x top_k x expert width,
    the gated-MLP rows that Architecture.intermediate_size = top_k x expert width already counts
  - down's output per routed row before its routing weight (top_k x hidden)
  - the router's fp32 probabilities (experts x 4 B), the top-k ids, the sort's permutation, sorted ids and
    inverse permutation (int64 each) and the routing weights
A frozen expert stack keeps nothing else (its input is saved only for a weight gradient). A stack peft's
LoRA wraps (core.arch.lora, target_parameters) is different: each forward folds the update into a new
tensor of the whole stack (W + B A, in the stack's dtype), which the grouped matmul keeps for the input's
gradient, and the matmul keeps its input rows for the update's gradient.

The load-balancing loss (Experts.aux_loss_coef > 0; training.moe): every layer's router logits are
kept until the loss, and their fp32 softmax for its backward, through the whole step.
"""

from __future__ import annotations

from core.arch import Architecture, LinearModule
from core.arch.lora import expert_lora

INDEX_BYTES = 4 * 8  # per routed row: top-k id, permutation, sorted id, inverse permutation (int64)


def routed_saved_per_token(
    arch: Architecture, compute_bytes: int, residual_bytes: int, lora: tuple[tuple[LinearModule, int], ...]
) -> float:
    """Bytes per token a sparse block keeps for backward beyond its gate/act/up rows (module doc). The
    routed rows have the dtype of the block's input, the residual stream's: autocast leaves the grouped
    matmul alone (torch's CPU autocast does not cast _grouped_mm), so fp32 experts under autocast make
    fp32 rows, which the gate/act/up count (in the compute dtype) is topped up to."""
    x = arch.experts
    if x is None:
        return 0.0
    e, k, h = compute_bytes, x.top_k, arch.hidden_size
    rb = routed_bytes(e, residual_bytes)
    kept = float(k * h * rb + x.num_experts * 4 + k * (INDEX_BYTES + 4))
    kept += 3 * arch.intermediate_size * max(0, rb - e)
    wrapped = set(expert_lora(arch, lora))
    for w in x.weights:
        if w.name in wrapped:
            kept += k * w.in_features * rb  # the grouped matmul's input rows, for the update's gradient
    return kept


def routed_bytes(compute_bytes: int, residual_bytes: int) -> int:
    """Bytes per value of the experts' rows: the residual stream's dtype (see routed_saved_per_token)."""
    return residual_bytes or compute_bytes


def routed_backward_per_token(arch: Architecture, compute_bytes: int, residual_bytes: int) -> int:
    """A sparse block's gradients in flight at its backward's widest, per token, beside its saved tensors:
    three [tokens x top_k, hidden] row gradients (the weighted sum's, the routing weight product's and
    the down stack's; measured on CPU over hidden 256-512, top_k 2-4, expert width 176-352: 3.0 x top_k x
    hidden x 4 B within 4%) and the block output's gradient."""
    x = arch.experts
    if x is None:
        return 0
    rb = routed_bytes(compute_bytes, residual_bytes)
    return rb * arch.hidden_size * (3 * x.top_k + 1)


def stack_copy_bytes(arch: Architecture, lora: tuple[tuple[LinearModule, int], ...], store_b: int) -> int:
    """One layer's LoRA'd expert stacks, W + B A made anew by each forward and kept by the grouped matmul
    (averaged over layers when not every layer's are wrapped)."""
    x = arch.experts
    if x is None:
        return 0
    per: dict[str, int] = {w.name: x.num_experts * w.in_features * w.out_features for w in x.weights}
    return sum(per[m.name] * store_b * n // arch.num_layers for m, n in lora if m.name in per)


def expert_weight_bytes(arch: Architecture, store_b: int) -> tuple[int, int]:
    """(Parameters, bytes) of every layer's experts and routers, in the storage dtype."""
    params = arch.num_layers * arch.experts.params if arch.experts else 0
    return params, params * store_b
