"""A downloaded ftune adapter is what serving engines' LoRA loaders read (the hand-off in docs/inference.md).

A tiny adapter is trained with ftune's own path (training.run -> training.export.save_adapter) and packed as
the download is (worker.artifacts.build_adapter_archive: flat adapter.tar.gz). The files are then checked
against what the engines' loaders do with them:

vLLM (vllm/lora/peft_helper.py, vllm/lora/lora_model.py, vllm/lora/utils.py):
- `PEFTHelper.from_dict(adapter_config.json)` requires `r`, `lora_alpha` and `target_modules`; it refuses
  `modules_to_save` other than None and `use_dora`; the scaling it applies is lora_alpha / r.
- `LoRAModel.from_local_checkpoint(lora_dir, ...)` reads `adapter_model.safetensors` (before .bin/.pt) with
  `safetensors.safe_open`; every key goes through `parse_fine_tuned_lora_name`, which strips
  `base_model.model.` and accepts only names ending `.lora_A.weight` / `.lora_B.weight` (an adapter-name
  infix such as `.default.` is "unsupported LoRA weight"); the module's last name must be one of the
  model's LoRA modules (for Llama the q/k/v, o, gate/up and down projections, packed qkv_proj and
  gate_up_proj unpacked), else "expected target modules in ... but received ...".
SGLang (python/sglang/srt/lora/lora_config.py, lora.py, utils.py): `LoRAConfig` reads `target_modules`, `r`
and `lora_alpha` from adapter_config.json in the adapter directory and normalizes each target by its last
dotted name (`get_normalized_target_modules`: "model.layers.0.mlp.down_proj" -> "down_proj"); the weights
are read from its *.safetensors files with the same `base_model.model.<module>.lora_A|B.weight` names
(layer id from `layers.<n>.`).
Both load the base by their own `--model` argument; `base_model_name_or_path` names it for people and tools.
"""

from __future__ import annotations

import json
import re
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from core.run_protocol import RunConfig
from tests.training.conftest import make_config, models_dir, tiny_model  # noqa: F401  (fixtures)
from training.run import run
from worker.artifacts import build_adapter_archive

pytestmark = pytest.mark.slow
PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>[A-Za-z0-9_.]+)\.lora_(?P<ab>[AB])\.weight$")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# vLLM's LlamaForCausalLM LoRA modules with packed_modules_mapping unpacked (qkv_proj, gate_up_proj)
LLAMA_LORA_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.fixture
def downloaded(make_config: Callable[..., RunConfig], tmp_path: Path) -> tuple[Path, RunConfig]:  # noqa: F811
    """The adapter as a user gets it: trained, archived as the worker does, extracted."""
    config = make_config(name="handoff", max_steps=2, lora_r=8, lora_alpha=16, base_model="tiny")
    assert run(config) == 0
    archive = build_adapter_archive(Path(config.output_dir))
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        assert all(m.isfile() and "/" not in m.name for m in members)  # flat: the directory engines load
        tar.extractall(tmp_path / "download", filter="data")
    return tmp_path / "download", config


def test_a_downloaded_adapter_is_what_vllm_and_sglang_load(
    downloaded: tuple[Path, RunConfig],
    tiny_model: Path,  # noqa: F811
) -> None:
    adapter, config = downloaded
    check_config(adapter, config)
    check_weights(adapter, tiny_model)


def check_config(adapter: Path, config: RunConfig) -> None:
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA"
    assert cfg["base_model_name_or_path"] == config.spec.base_model  # a name, not this server's path
    assert (cfg["r"], cfg["lora_alpha"]) == (8, 16)  # PEFTHelper's scaling: 16 / 8
    targets = cfg["target_modules"]
    assert isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)
    assert {t.rsplit(".", 1)[-1] for t in targets} <= LLAMA_LORA_MODULES  # SGLang's normalized names
    assert not cfg.get("modules_to_save") and not cfg.get("use_dora")  # vLLM refuses both


def check_weights(adapter: Path, tiny_model: Path) -> None:  # noqa: F811
    files = sorted(p.name for p in adapter.iterdir())
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    assert not [f for f in files if f.endswith(PICKLE_SUFFIXES)], files
    targets = {
        t.rsplit(".", 1)[-1]
        for t in json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    }

    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True, trust_remote_code=False)
    linears = {name: m for name, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
    pairs: dict[str, set[str]] = {}
    with safe_open(adapter / "adapter_model.safetensors", framework="pt") as f:
        for key in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
            m = PEFT_KEY.match(key)
            assert m is not None, f"not a PEFT LoRA tensor name: {key}"
            module = m["module"]
            assert ".default" not in key, key  # no adapter-name infix
            assert module.rsplit(".", 1)[-1] in LLAMA_LORA_MODULES, key  # vLLM's expected-modules check
            assert module in linears, f"{module} is not a linear layer of the base model"
            shape = tuple(f.get_slice(key).get_shape())
            layer = linears[module]
            assert shape == ((8, layer.in_features) if m["ab"] == "A" else (layer.out_features, 8)), key
            pairs.setdefault(module, set()).add(m["ab"])
    assert pairs and all(ab == {"A", "B"} for ab in pairs.values())
    assert {name.rsplit(".", 1)[-1] for name in pairs} == targets  # every target was trained and saved
