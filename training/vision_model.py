"""A vision-language base as a model (Qwen2.5-VL): which bases are one, the transformers class that loads
them, and how their tower runs inside ftune's packed training. Its data (images through the image
processor, 3-D positions) is training.vision's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.arch.vision import TOWER_PREFIX
from core.arch.vl_families import BUILDERS as VL_FAMILIES

# FlashAttentionKwargs of a packed row: the language model's example bounds, which the tower must not read
PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def is_vision_base(model_dir: Path | str) -> bool:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in VL_FAMILIES


def unquantized_modules(model_dir: Path | str) -> list[str] | None:
    """What QLoRA's 4-bit loading leaves unquantized: for a vision-language base its tower and projector
    (frozen, so image features keep the base's precision; the planner counts them unquantized, with the
    embeddings and the head) and the head, named since an explicit list replaces transformers' default
    skips; None for a text base (transformers' default: the head and tied weights)."""
    return [TOWER_PREFIX, "lm_head"] if is_vision_base(model_dir) else None


def prepare_model(net: Any) -> None:
    """The tower attends with SDPA over its own images and never reads a packed row's bounds."""
    base: Any = getattr(net, "get_base_model", lambda: net)()
    visual = base.model.visual
    base.config.vision_config._attn_implementation = "sdpa"

    def drop_packed(_module: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return args, {k: v for k, v in kwargs.items() if k not in PACKED_KWARGS}

    visual.register_forward_pre_hook(drop_packed, with_kwargs=True)


def auto_model_class(model_dir: Path) -> Any:
    """transformers' Auto class that loads this base: image-text-to-text for a vision-language one."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_base(model_dir) else AutoModelForCausalLM
