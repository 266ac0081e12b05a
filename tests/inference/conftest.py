"""Fixtures for the inference engine: the tiny demo model in a catalog, adapters with random LoRA weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from core.catalog import Catalog
from training.demo import TINY, build_demo_model

BASE = "tiny"


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_dir: Path) -> Path:
    return build_demo_model(models_dir, name=BASE, size=TINY)


@pytest.fixture(scope="session")
def catalog(models_dir: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Catalog:
    return Catalog(models_dir, hf_cache=tmp_path_factory.mktemp("no-hf-cache"))


@pytest.fixture(scope="session")
def make_adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make_adapter(seed) -> the directory of a LoRA adapter for the tiny model with random A and B
    (B is zero at peft's init, which would make every adapter equal to the base)."""
    root = tmp_path_factory.mktemp("adapters")

    def make(seed: int, r: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj", "down_proj")) -> Path:
        return save_random_adapter(tiny_model, root / f"adapter{seed}-r{r}", seed, r, list(targets))

    return make


_PEFT_MODELS: dict[tuple, object] = {}  # one peft model per (base, r, targets), re-randomized per adapter


def save_random_adapter(model_dir: Path, out: Path, seed: int, r: int, targets: list[str]) -> Path:
    """A LoRA adapter saved by peft (save_pretrained, safetensors) with A and B drawn from `seed`."""
    if (out / "adapter_model.safetensors").is_file():
        return out
    import json

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    key = (str(model_dir), r, tuple(targets))
    if key not in _PEFT_MODELS:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, local_files_only=True, trust_remote_code=False
        )
        config = LoraConfig(
            r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM"
        )
        _PEFT_MODELS[key] = get_peft_model(model, config)
    peft = _PEFT_MODELS[key]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():  # type: ignore[attr-defined]
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    peft.save_pretrained(out, safe_serialization=True)  # type: ignore[attr-defined]
    # as ftune's training writes it (training.export): the base by name, not this machine's path
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = model_dir.name
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out
