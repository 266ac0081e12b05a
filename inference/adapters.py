"""LoRA adapters: checking a registration (no torch), and attaching / evicting one on a loaded base.

Only `adapter_config.json` (JSON) and `adapter_model.safetensors` are ever read: peft's own loaders would
fall back to a pickled `adapter_model.bin` or to the Hub, so the weights are read with safetensors and set
with peft's `set_peft_model_state_dict` (as training.model does for `init_from`).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.catalog import BaseModelInfo, Catalog
from core.errors import NotFound
from inference.errors import invalid

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
MAX_NAME = 256


@dataclass(frozen=True)
class Adapter:
    """A registered adapter: its name in requests, its directory and the catalog base it runs on."""

    name: str
    path: Path
    base: str
    rank: int
    nbytes: int  # the adapter's weights as read (fp32 once resident: see resident_bytes)


def check_adapter(
    name: str, path: str, base_model: str | None, catalog: Catalog, root: Path | None = None
) -> Adapter:
    """The adapter at `path`, checked without loading it: a PEFT LoRA directory whose base (given, or its
    config's base_model_name_or_path) is in the catalog. Raises a 400 EngineError otherwise."""
    if not name or len(name) > MAX_NAME or name.strip() != name:
        raise invalid(f"lora_name must be 1-{MAX_NAME} characters without surrounding spaces", "lora_name")
    directory = Path(path).expanduser()
    if not directory.is_absolute():
        raise invalid("lora_path must be an absolute path", "lora_path")
    directory = directory.resolve()
    if root is not None and not directory.is_relative_to(root):
        raise invalid(f"lora_path must be under this engine's adapter root {root}", "lora_path")
    if not (directory / CONFIG).is_file() or not (directory / WEIGHTS).is_file():
        raise invalid(
            f"{path!r} is not a PEFT adapter directory ({CONFIG} and {WEIGHTS} expected)",
            "lora_path",
            code="invalid_adapter",
        )
    try:
        config = json.loads((directory / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise invalid(f"cannot read {CONFIG}: {e}", "lora_path", code="invalid_adapter") from e
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise invalid(
            f"{CONFIG} is not a LoRA adapter's (peft_type LORA)", "lora_path", code="invalid_adapter"
        )
    nbytes = _safetensors_payload_bytes(directory / WEIGHTS)
    base_name = base_model or config.get("base_model_name_or_path")
    if not isinstance(base_name, str) or not base_name:
        raise invalid(
            f"{CONFIG} names no base_model_name_or_path; pass base_model", "base_model", code="unknown_base"
        )
    info = resolve_base(catalog, base_name)
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise invalid(f"{CONFIG} has no valid rank r", "lora_path", code="invalid_adapter")
    return Adapter(name=name, path=directory, base=info.name, rank=rank, nbytes=nbytes)


def resolve_base(catalog: Catalog, name: str) -> BaseModelInfo:
    try:
        return catalog.get(name)
    except NotFound as e:
        raise invalid(
            f"base model {name!r} is not in this engine's catalog", "base_model", code="unknown_base"
        ) from e


def _safetensors_payload_bytes(path: Path) -> int:
    """Bytes of the tensors a safetensors file holds, from its JSON header (the file is not loaded).
    A file that is not safetensors is refused here rather than at first use."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 * 2**20:
                raise ValueError("header too large")
            header = json.loads(f.read(size))
        spans = [v["data_offsets"] for k, v in header.items() if k != "__metadata__"]
        if not spans:
            raise ValueError("no tensors")
        return sum(end - start for start, end in spans)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise invalid(f"{WEIGHTS} is not a safetensors file: {e}", "lora_path", code="invalid_adapter") from e


# -- on a loaded base (torch, peft; called from the generation thread only) ---------------------------------


def attach(model, slot: str, adapter: Adapter):
    """Load `adapter` into `model` as peft adapter `slot`; returns the PeftModel (made from the plain base
    the first time). The base weights are shared by every adapter: peft wraps the same modules."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    config = LoraConfig.from_pretrained(str(adapter.path))
    config.inference_mode = True
    config.lora_dropout = 0.0
    if isinstance(model, PeftModel):
        model.add_adapter(slot, config)
    else:
        model = get_peft_model(model, config, adapter_name=slot)
    weights = load_file(adapter.path / WEIGHTS)
    result: Any = set_peft_model_state_dict(model, weights, adapter_name=slot)  # load_state_dict's result
    missing = [k for k in result.missing_keys if ".lora_" in k and f".{slot}." in k]
    if missing or result.unexpected_keys:
        model.delete_adapter(slot)
        raise invalid(
            f"adapter {adapter.name!r} does not fit base {adapter.base!r} (missing {missing[:3]}, "
            f"unexpected {list(result.unexpected_keys)[:3]})",
            "model",
            code="invalid_adapter",
        )
    model.eval()
    return model


def resident_bytes(model, slot: str) -> int:
    """Bytes of the adapter `slot`'s tensors as they sit in `model`."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if f".{slot}." in n)
