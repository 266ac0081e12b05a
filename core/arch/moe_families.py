"""Mixture-of-experts decoder blocks, as transformers 5 builds them: Qwen3-MoE and Mixtral.

Both are Llama-like blocks (RMSNorm, rotary, GQA attention; Qwen3's with q/k norms) whose MLP is a sparse
block on every layer: a router (`mlp.gate`, [experts, hidden], no bias) picks top_k experts per token
from num_experts gated-SiLU experts, stored as two stacks (core.arch.experts). Defaults for missing keys
are those of Qwen3MoeConfig and MixtralConfig (transformers 5.24).

Not read: a qwen3_moe whose config makes some layers dense (mlp_only_layers, decoder_sparse_step > 1) is
refused, as no released Qwen3-MoE has them and their MLP names collide with peft's expert names
(core.arch.lora).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.arch.experts import Experts, ExpertWeight
from core.arch.families import _int, _lin, decoder_fields
from core.arch.types import Architecture
from core.errors import InvalidInput, Unsupported

# vocab, hidden, layers, heads, kv heads, head_dim (None: hidden // heads), expert intermediate,
# experts, top_k, the experts key of the config (transformers' attribute_map aliases both)
_DEFAULTS: dict[str, tuple[int, int, int, int, int, int | None, int, int, int]] = {
    "qwen3_moe": (151936, 2048, 24, 32, 4, None, 768, 128, 8),
    "mixtral": (32000, 4096, 32, 32, 8, None, 14336, 8, 2),
}


def _float(c: dict[str, Any], key: str, default: float) -> float:
    v = c.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise InvalidInput(f"config.json: {key} must be a number >= 0, got {v!r}", param="base_model")
    return float(v)


def _experts(c: dict[str, Any], hidden: int, inter: int, num: int, top_k: int) -> Experts:
    if top_k > num:
        raise InvalidInput(
            f"config.json: num_experts_per_tok {top_k} exceeds the {num} experts", param="base_model"
        )
    return Experts(
        num_experts=num,
        top_k=top_k,
        expert_intermediate=inter,
        weights=(
            ExpertWeight(
                name="mlp.experts.gate_up_proj",
                in_features=hidden,
                out_features=2 * inter,
                bias=False,
                group="mlp_in",
            ),
            ExpertWeight(
                name="mlp.experts.down_proj",
                in_features=inter,
                out_features=hidden,
                bias=False,
                group="mlp_mid",
            ),
        ),
        module="mlp.experts",
        router="mlp.gate",
        router_in=hidden,
        router_bias=False,
        output_router_logits=bool(c.get("output_router_logits", False)),
        router_aux_loss_coef=_float(c, "router_aux_loss_coef", 0.001),
    )


def _check_sparse(c: dict[str, Any]) -> None:
    dense = c.get("mlp_only_layers") or []
    step = c.get("decoder_sparse_step", 1)
    if dense or step not in (None, 1):
        raise Unsupported(
            f"a qwen3_moe with dense layers (mlp_only_layers {dense}, decoder_sparse_step {step}) is not "
            "supported; every released Qwen3-MoE is sparse on every layer",
            code="unsupported_architecture",
            param="base_model",
        )


def _moe(c: dict[str, Any]) -> Architecture:
    """Qwen3-MoE (qk norms, attention_bias on q/k/v/o) or Mixtral."""
    mt = c["model_type"]
    v0, h0, l0, a0, kv0, hd0, i0, e0, k0 = _DEFAULTS[mt]
    if mt == "qwen3_moe":
        _check_sparse(c)
    hidden = _int(c, "hidden_size", default=h0)
    heads = _int(c, "num_attention_heads", default=a0)
    kv = _int(c, "num_key_value_heads", default=kv0)
    head_dim = _int(c, "head_dim", default=hd0 or hidden // heads)
    inter = _int(c, "moe_intermediate_size" if mt == "qwen3_moe" else "intermediate_size", default=i0)
    num = _int(c, "num_experts", "num_local_experts", default=e0)
    top_k = _int(c, "num_experts_per_tok", default=k0)
    q, k = heads * head_dim, kv * head_dim
    bias = bool(c.get("attention_bias", False)) if mt == "qwen3_moe" else False
    qk_norm = mt == "qwen3_moe"
    norms = ("input_layernorm", "post_attention_layernorm")
    return Architecture(
        **decoder_fields(c, v0, l0, hidden, heads, kv, head_dim, norms, qk_norm),
        intermediate_size=top_k * inter,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        block_linears=(
            _lin("self_attn.q_proj", hidden, q, bias, "attn_in"),
            _lin("self_attn.k_proj", hidden, k, bias, "attn_in"),
            _lin("self_attn.v_proj", hidden, k, bias, "attn_in"),
            _lin("self_attn.o_proj", q, hidden, bias, "attn_out"),
        ),
        hidden_act=str(c.get("hidden_act") or "silu"),
        experts=_experts(c, hidden, inter, num, top_k),
    )


BUILDERS: dict[str, Callable[[dict[str, Any]], Architecture]] = dict.fromkeys(_DEFAULTS, _moe)
