"""Time per epoch from the FLOPs a token costs: the plan's speed estimate, apart from its memory model."""

from __future__ import annotations

from core.arch import Architecture
from core.spec import JobSpec
from planner.gpus import Gpu

MFU = {"full": 0.40, "lora": 0.40, "qlora": 0.28}  # assumed model-FLOPs utilisation


def epoch_seconds(
    spec: JobSpec, arch: Architecture, gpu: Gpu, trainable: int, tokens: int | None
) -> tuple[float | None, str | None]:
    """FLOPs/token: forward F = 2 x matmul weights + causal attention 2 x seq x q_dim per layer;
        backward = 2F (full: grads w.r.t. activations and weights) or F + attention (LoRA/QLoRA: activations
        only, frozen weights) + 6 x LoRA params; checkpointing re-runs the forward, and dpo's reference policy
    runs one more (a pair's tokens, both sides, are the tokens). Time = FLOPs x tokens /
        (num_gpus x dense bf16 FLOP/s x assumed MFU)."""
    if tokens is None or gpu.bf16_flops is None:
        return None, "needs tokens_per_epoch and a known GPU type" if gpu.bf16_flops is None else None
    f_lin = 2 * arch.matmul_params
    f_attn = 2 * spec.max_seq_len * arch.num_heads * arch.head_dim * arch.num_layers
    fwd = f_lin + f_attn
    bwd = 2 * fwd if spec.method == "full" else f_lin + 2 * f_attn + 6 * trainable
    per_token = fwd + bwd + (fwd if spec.gradient_checkpointing else 0)
    per_token += fwd if spec.preference.uses_reference else 0  # dpo: the reference policy's forward
    mfu = MFU[spec.method]
    seconds = per_token * tokens / (spec.num_gpus * gpu.bf16_flops * mfu)
    return seconds, (
        f"{per_token / 1e9:.1f} GFLOP/token x {tokens:,} tokens at {mfu:.0%} of "
        f"{gpu.bf16_flops / 1e12:.0f} TFLOP/s x {spec.num_gpus} GPU(s)"
    )
