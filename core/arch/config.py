"""Model architecture read from a local config.json (never the weights)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.arch import families, moe_families, vl_families
from core.arch.types import Architecture
from core.errors import FtuneError, InvalidInput, Unsupported

# Every family the planner reads: dense (core.arch.families), mixture-of-experts (core.arch.moe_families)
# and vision-language (core.arch.vl_families).
BUILDERS = {**families.BUILDERS, **moe_families.BUILDERS, **vl_families.BUILDERS}


def load_architecture(model_dir: Path | str) -> Architecture:
    """Read `model_dir/config.json` (and nothing else)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"cannot read {path.name} of the base model: {exc}", param="base_model") from exc
    if not isinstance(config, dict):
        raise InvalidInput("config.json is not a JSON object", param="base_model")
    return from_config(config)


def from_config(config: dict[str, Any]) -> Architecture:
    model_type = str(config.get("model_type", ""))
    if model_type in ("gemma3", "mistral3") and isinstance(config.get("text_config"), dict):
        raise Unsupported(f"multimodal {model_type} models are not supported; use a text-only checkpoint")
    build = BUILDERS.get(model_type)
    if build is None:
        raise Unsupported(
            f"model_type {model_type!r} is not supported by the planner; supported: {sorted(BUILDERS)}",
            code="unsupported_architecture",
            param="base_model",
        )
    return build(config)


# What GET /models and the dashboard call each family (model_type -> name); others show their model_type.
FAMILY_NAMES = {
    "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma",
    "gemma2": "Gemma 2", "gemma3_text": "Gemma 3", "phi3": "Phi-3", "gpt2": "GPT-2", "gpt_neox": "GPT-NeoX",
    "falcon": "Falcon", "qwen3_moe": "Qwen3-MoE", "mixtral": "Mixtral", "qwen2_5_vl": "Qwen2.5-VL",
}  # fmt: skip


@dataclass(frozen=True)
class Facts:
    """A base model's family, size and modality, from its config.json (None: a family ftune cannot read)."""

    family: str
    modality: str
    total_params: int | None
    active_params: int | None  # parameters a token uses: a MoE base's fewer than total


def describe(config: dict[str, Any]) -> Facts:
    model_type = str(config.get("model_type", "unknown"))
    family = FAMILY_NAMES.get(model_type, model_type)
    try:
        arch = from_config(config)
    except FtuneError:
        vision = any(k in config for k in ("vision_config", "audio_config"))
        return Facts(family, "text+image" if vision else "text", None, None)
    return Facts(family, arch.modality, arch.total_params, arch.active_params)
