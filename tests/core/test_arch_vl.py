"""Vision-language architectures (core.arch.vl_families) against transformers' own Qwen2.5-VL and peft.

The released Qwen/Qwen2.5-VL-7B-Instruct config.json is copied in tests/configs (flat, as the Hub has
it); its model card's size is 8.29B parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.arch import describe, from_config
from core.arch.lora import peft_targets

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CONFIG_7B = json.loads((Path(__file__).parents[1] / "configs" / "Qwen2.5-VL-7B-Instruct.json").read_text())
TINY = dict(
    text_config=dict(vocab_size=96, hidden_size=64, intermediate_size=40, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
    vision_config=dict(depth=2, hidden_size=32, intermediate_size=24, num_heads=2, out_hidden_size=64),
    image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93,
)  # fmt: skip


def _tiny():
    config = transformers.Qwen2_5_VLConfig(**TINY)
    torch.manual_seed(0)
    return config, transformers.Qwen2_5_VLForConditionalGeneration(config)


def test_7b_counts_every_parameter_of_transformers_model() -> None:
    arch = from_config(CONFIG_7B)
    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(**CONFIG_7B))
    assert arch.total_params == sum(p.numel() for p in model.parameters()) == 8_292_166_656
    assert arch.vision is not None
    assert arch.vision.params == sum(p.numel() for p in model.model.visual.parameters())
    assert arch.modality == "text+image" and describe(CONFIG_7B).family == "Qwen2.5-VL"


def test_tiny_counts_from_transformers_5_nested_config() -> None:
    config, model = _tiny()
    arch = from_config(
        json.loads(json.dumps(config.to_dict()))
    )  # text_config nested, as transformers 5 saves
    assert arch.total_params == sum(p.numel() for p in model.parameters())
    assert arch.layers_prefix == "model.language_model.layers"


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "down_proj"], ["q_proj", "merger"]])
def test_peft_wraps_the_language_model_and_never_the_tower(targets) -> None:
    config, model = _tiny()
    arch = from_config(config.to_dict())
    modules, _ = peft_targets(arch, targets)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=modules))
    trained = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert sum(p.numel() for p in wrapped.parameters() if p.requires_grad) == arch.lora_params(targets, 4)
    tower = [n for n in trained if ".visual." in n]
    if "merger" in targets:
        assert tower and all(".visual.merger." in n for n in tower)
    else:
        assert not tower
    # peft's own reading of the short names would wrap the tower's mlp.down_proj too
    if isinstance(targets, list) and "down_proj" in targets:
        _, fresh = _tiny()
        naive = peft.get_peft_model(fresh, peft.LoraConfig(r=4, target_modules=targets))
        assert any(".visual.blocks." in n for n, p in naive.named_parameters() if p.requires_grad)
