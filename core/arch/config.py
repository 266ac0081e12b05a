"""Model architecture read from a local config.json (never the weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.arch import families
from core.arch.types import Architecture
from core.errors import InvalidInput, Unsupported


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
    build = families.BUILDERS.get(model_type)
    if build is None:
        raise Unsupported(
            f"model_type {model_type!r} is not supported by the planner; supported: "
            f"{sorted(families.BUILDERS)}",
            code="unsupported_architecture",
            param="base_model",
        )
    return build(config)
