"""Vision-language bases, as transformers 5 builds them: Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration).

Its language model is a Qwen2 decoder (q/k/v with bias, o_proj and the gated MLP without) under
`model.language_model`; the vision tower and projector (core.arch.vision) under `model.visual`. The Hub's
config.json is flat (the language model's keys at the top, as transformers 4 saved it) while transformers 5
saves them in a `text_config`: both are read. Defaults for missing keys are those of Qwen2_5_VLTextConfig
and Qwen2_5_VLVisionConfig (transformers 5.24).

Not read: Qwen2-VL (its tower has LayerNorms and a plain MLP) and Qwen3-VL (deepstack mergers); they are
refused as unsupported architectures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.arch.families import _int, decoder_fields, llama_block_linears
from core.arch.types import Architecture
from core.arch.vision import VisionTower

LANGUAGE = "model.language_model"


def _text_config(c: dict[str, Any]) -> dict[str, Any]:
    """The language model's keys, from `text_config` (transformers 5) over the top level (the Hub's)."""
    nested = c.get("text_config")
    top = {k: v for k, v in c.items() if k not in ("text_config", "vision_config")}
    return {**top, **(nested if isinstance(nested, dict) else {}), "model_type": c["model_type"]}


def vision_tower(c: dict[str, Any]) -> VisionTower:
    nested = c.get("vision_config")
    v: dict[str, Any] = nested if isinstance(nested, dict) else {}
    return VisionTower(
        depth=_int(v, "depth", "num_hidden_layers", default=32),
        hidden_size=_int(v, "hidden_size", "embed_dim", default=3584),
        intermediate_size=_int(v, "intermediate_size", default=3420),
        num_heads=_int(v, "num_heads", default=16),
        in_channels=_int(v, "in_channels", "in_chans", default=3),
        patch_size=_int(v, "patch_size", "spatial_patch_size", default=14),
        temporal_patch_size=_int(v, "temporal_patch_size", default=2),
        merge_size=_int(v, "spatial_merge_size", default=2),
        out_hidden_size=_int(v, "out_hidden_size", default=3584),
    )


def _qwen2_5_vl(c: dict[str, Any]) -> Architecture:
    t = _text_config(c)
    hidden = _int(t, "hidden_size", default=8192)
    heads = _int(t, "num_attention_heads", default=64)
    kv = _int(t, "num_key_value_heads", default=8)
    head_dim = hidden // heads
    inter = _int(t, "intermediate_size", default=29568)
    q, k = heads * head_dim, kv * head_dim
    norms = ("input_layernorm", "post_attention_layernorm")
    fields = decoder_fields(t, 152064, 80, hidden, heads, kv, head_dim, norms, qk_norm=False)
    fields |= {
        "layers_prefix": f"{LANGUAGE}.layers",
        "embed_names": (f"{LANGUAGE}.embed_tokens",),
        "final_norm_name": f"{LANGUAGE}.norm",
    }
    return Architecture(
        **fields,
        intermediate_size=inter,
        tie_word_embeddings=bool(c.get("tie_word_embeddings") or t.get("tie_word_embeddings")),
        block_linears=llama_block_linears(hidden, q, k, inter, True, False, False),
        hidden_act=str(t.get("hidden_act") or "silu"),
        modality="text+image",
        vision=vision_tower(c),
    )


BUILDERS: dict[str, Callable[[dict[str, Any]], Architecture]] = {"qwen2_5_vl": _qwen2_5_vl}
