"""Per-family decoder block layouts, as transformers 5 builds them (module names, shapes, biases).

Each builder takes a config.json dict and returns an Architecture. Defaults for missing keys are
those of the family's transformers config class. Fused projections are kept fused, as in the model:
phi3 qkv_proj and gate_up_proj, gpt_neox/falcon query_key_value, gpt2 c_attn (a Conv1D).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.arch.types import Architecture, LinearModule
from core.errors import InvalidInput

_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


def _dtype(c: dict[str, Any]) -> str | None:
    value = c.get("dtype", c.get("torch_dtype"))
    return _DTYPES.get(str(value).removeprefix("torch.")) if value else None


def _int(c: dict[str, Any], *keys: str, default: int | None = None) -> int:
    for k in keys:
        if c.get(k) is not None:
            v = c[k]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise InvalidInput(
                    f"config.json: {k} must be a positive integer, got {v!r}", param="base_model"
                )
            return v
    if default is None:
        raise InvalidInput(f"config.json has no {keys[0]}", param="base_model")
    return default


def _lin(name: str, i: int, o: int, bias: bool, group: str) -> LinearModule:
    return LinearModule(name=name, in_features=i, out_features=o, bias=bias, group=group)  # type: ignore[arg-type]


# Config-class defaults (transformers 5): vocab, hidden, intermediate, layers, heads, kv heads
# (None: = heads), head_dim (None: hidden // heads), tied.
_LLAMA_DEFAULTS: dict[str, tuple[int, int, int, int, int, int | None, int | None, bool]] = {
    "llama": (32000, 4096, 11008, 32, 32, None, None, False),
    "mistral": (32000, 4096, 14336, 32, 32, 8, None, False),
    "qwen2": (151936, 4096, 22016, 32, 32, 32, None, False),
    "qwen3": (151936, 4096, 22016, 32, 32, 32, 128, False),
    "gemma": (256000, 3072, 24576, 28, 16, 16, 256, True),
    "gemma2": (256000, 2304, 9216, 26, 8, 4, 256, True),
    "gemma3_text": (262208, 2304, 9216, 26, 8, 4, 256, True),
    "phi3": (32064, 3072, 8192, 32, 32, None, None, False),
}


def llama_block_linears(
    hidden: int, q: int, k: int, inter: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool
) -> tuple[LinearModule, ...]:
    """A Llama-like block's linears: q, k, v and o projections, then the gated MLP's three."""
    return (
        _lin("self_attn.q_proj", hidden, q, qkv_bias, "attn_in"),
        _lin("self_attn.k_proj", hidden, k, qkv_bias, "attn_in"),
        _lin("self_attn.v_proj", hidden, k, qkv_bias, "attn_in"),
        _lin("self_attn.o_proj", q, hidden, o_bias, "attn_out"),
        _lin("mlp.gate_proj", hidden, inter, mlp_bias, "mlp_in"),
        _lin("mlp.up_proj", hidden, inter, mlp_bias, "mlp_in"),
        _lin("mlp.down_proj", inter, hidden, mlp_bias, "mlp_mid"),
    )


def _llama_like(c: dict[str, Any]) -> Architecture:
    """Llama, Mistral, Qwen2/2.5, Qwen3, Gemma/Gemma2/Gemma3 (text), Phi-3: RMSNorm, rotary, gated MLP."""
    mt = c["model_type"]
    v0, h0, i0, l0, a0, kv0, hd0, tie0 = _LLAMA_DEFAULTS[mt]
    hidden = _int(c, "hidden_size", default=h0)
    heads = _int(c, "num_attention_heads", default=a0)
    kv = _int(c, "num_key_value_heads", default=kv0 or heads)
    head_dim = _int(c, "head_dim", default=hd0 or hidden // heads)
    inter = _int(c, "intermediate_size", default=i0)
    q, k = heads * head_dim, kv * head_dim
    attn_bias = bool(c.get("attention_bias", False))
    qkv_bias = {"qwen2": True, "mistral": False, "phi3": False}.get(mt, attn_bias)
    o_bias = False if mt in ("qwen2", "mistral", "phi3") else attn_bias
    mlp_bias = bool(c.get("mlp_bias", False)) if mt == "llama" else False
    linears: tuple[LinearModule, ...]
    if mt == "phi3":
        linears = (
            _lin("self_attn.qkv_proj", hidden, q + 2 * k, False, "attn_in"),
            _lin("self_attn.o_proj", q, hidden, False, "attn_out"),
            _lin("mlp.gate_up_proj", hidden, 2 * inter, False, "mlp_in"),
            _lin("mlp.down_proj", inter, hidden, False, "mlp_mid"),
        )
    else:
        linears = llama_block_linears(hidden, q, k, inter, qkv_bias, o_bias, mlp_bias)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if mt in ("gemma2", "gemma3_text"):
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    qk_norm = mt in ("qwen3", "gemma3_text")
    return Architecture(
        **decoder_fields(c, v0, l0, hidden, heads, kv, head_dim, tuple(norms), qk_norm),
        intermediate_size=inter,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", tie0)),
        block_linears=linears,
        hidden_act=str(c.get("hidden_activation") or c.get("hidden_act") or "silu"),
    )


def decoder_fields(
    c: dict[str, Any],
    vocab: int,
    layers: int,
    hidden: int,
    heads: int,
    kv: int,
    head_dim: int,
    norms: tuple[str, ...],
    qk_norm: bool,
) -> dict[str, Any]:
    """The Architecture fields every Llama-like decoder (dense or mixture of experts) reads alike: sizes,
    RMSNorms (q/k norms too where it has them), rotary positions, a gated MLP, HF's module names."""
    return {
        "model_type": c["model_type"],
        "vocab_size": _int(c, "vocab_size", default=vocab),
        "hidden_size": hidden,
        "num_layers": _int(c, "num_hidden_layers", default=layers),
        "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": head_dim,
        "config_dtype": _dtype(c),
        "norms_per_layer": len(norms),
        "norm_params_per_layer": len(norms) * hidden + (2 * head_dim if qk_norm else 0),
        "qk_norm": qk_norm,
        "final_norm_params": hidden,
        "position_embeddings": 0,
        "gated_mlp": True,
        "layers_prefix": "model.layers",
        "embed_names": ("model.embed_tokens",),
        "final_norm_name": "model.norm",
        "block_norm_names": norms + (("self_attn.q_norm", "self_attn.k_norm") if qk_norm else ()),
    }


def _gpt2(c: dict[str, Any]) -> Architecture:
    hidden = _int(c, "n_embd", "hidden_size", default=768)
    heads = _int(c, "n_head", "num_attention_heads", default=12)
    inter = _int(c, "n_inner", default=4 * hidden)
    return Architecture(
        model_type="gpt2",
        vocab_size=_int(c, "vocab_size", default=50257),
        hidden_size=hidden,
        num_layers=_int(c, "n_layer", "num_hidden_layers", default=12),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=inter,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
        config_dtype=_dtype(c),
        block_linears=(
            _lin("attn.c_attn", hidden, 3 * hidden, True, "attn_in"),
            _lin("attn.c_proj", hidden, hidden, True, "attn_out"),
            _lin("mlp.c_fc", hidden, inter, True, "mlp_in"),
            _lin("mlp.c_proj", inter, hidden, True, "mlp_mid"),
        ),
        norms_per_layer=2,
        norm_params_per_layer=4 * hidden,
        qk_norm=False,
        final_norm_params=2 * hidden,
        position_embeddings=_int(c, "n_positions", "max_position_embeddings", default=1024),
        gated_mlp=False,
        hidden_act=str(c.get("activation_function", "gelu_new")),
        layers_prefix="transformer.h",
        embed_names=("transformer.wte", "transformer.wpe"),
        final_norm_name="transformer.ln_f",
        block_norm_names=("ln_1", "ln_2"),
    )


def _gpt_neox(c: dict[str, Any]) -> Architecture:
    hidden = _int(c, "hidden_size", default=6144)
    heads = _int(c, "num_attention_heads", default=64)
    inter = _int(c, "intermediate_size", default=24576)
    bias = bool(c.get("attention_bias", True))
    return Architecture(
        model_type="gpt_neox",
        vocab_size=_int(c, "vocab_size", default=50432),
        hidden_size=hidden,
        num_layers=_int(c, "num_hidden_layers", default=44),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=inter,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        config_dtype=_dtype(c),
        block_linears=(
            _lin("attention.query_key_value", hidden, 3 * hidden, bias, "attn_in"),
            _lin("attention.dense", hidden, hidden, bias, "attn_out"),
            _lin("mlp.dense_h_to_4h", hidden, inter, True, "mlp_in"),
            _lin("mlp.dense_4h_to_h", inter, hidden, True, "mlp_mid"),
        ),
        norms_per_layer=2,
        norm_params_per_layer=4 * hidden,
        qk_norm=False,
        final_norm_params=2 * hidden,
        position_embeddings=0,
        gated_mlp=False,
        hidden_act=str(c.get("hidden_act", "gelu")),
        layers_prefix="gpt_neox.layers",
        embed_names=("gpt_neox.embed_in",),
        final_norm_name="gpt_neox.final_layer_norm",
        block_norm_names=("input_layernorm", "post_attention_layernorm"),
    )


def _falcon(c: dict[str, Any]) -> Architecture:
    hidden = _int(c, "hidden_size", "n_embed", default=4544)
    heads = _int(c, "num_attention_heads", "n_head", default=71)
    head_dim = hidden // heads
    new_arch = bool(c.get("new_decoder_architecture", False))
    multi_query = bool(c.get("multi_query", True))
    parallel = bool(c.get("parallel_attn", True))
    bias = bool(c.get("bias", False))
    if new_arch:
        kv = _int(c, "num_kv_heads", "n_head_kv", default=heads)
        qkv_out = (2 * kv + heads) * head_dim
    elif multi_query:
        kv, qkv_out = 1, hidden + 2 * head_dim
    else:
        kv, qkv_out = heads, 3 * hidden
    inter = _int(c, "ffn_hidden_size", default=4 * hidden)
    n_ln = c.get("num_ln_in_parallel_attn") or (2 if new_arch else 1)
    if not parallel:
        norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    elif n_ln == 2:
        norms = ("ln_attn", "ln_mlp")
    else:
        norms = ("input_layernorm",)
    return Architecture(
        model_type="falcon",
        vocab_size=_int(c, "vocab_size", default=65024),
        hidden_size=hidden,
        num_layers=_int(c, "num_hidden_layers", "n_layer", default=32),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        intermediate_size=inter,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
        config_dtype=_dtype(c),
        block_linears=(
            _lin("self_attention.query_key_value", hidden, qkv_out, bias, "attn_in"),
            _lin("self_attention.dense", hidden, hidden, bias, "attn_out"),
            _lin("mlp.dense_h_to_4h", hidden, inter, bias, "mlp_in"),
            _lin("mlp.dense_4h_to_h", inter, hidden, bias, "mlp_mid"),
        ),
        norms_per_layer=len(norms),
        norm_params_per_layer=2 * hidden * len(norms),
        qk_norm=False,
        final_norm_params=2 * hidden,
        position_embeddings=0,
        gated_mlp=False,
        hidden_act=str(c.get("activation", "gelu")),
        layers_prefix="transformer.h",
        embed_names=("transformer.word_embeddings",),
        final_norm_name="transformer.ln_f",
        block_norm_names=norms,
    )


BUILDERS: dict[str, Callable[[dict[str, Any]], Architecture]] = {
    **dict.fromkeys(_LLAMA_DEFAULTS, _llama_like),
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "falcon": _falcon,
    "RefinedWebModel": lambda c: _falcon({**c, "model_type": "falcon"}),
    "RefinedWeb": lambda c: _falcon({**c, "model_type": "falcon", "new_decoder_architecture": True}),
}
