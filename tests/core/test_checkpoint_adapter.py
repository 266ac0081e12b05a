"""A checkpoint's adapter as PEFT's directory (core.checkpoint_adapter): made from a real peft model's
trainable parameters (what training.checkpoint saves) and checked against its own save_pretrained (what
training.export saves), then loaded back by peft with the checkpoint's values."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.checkpoint_adapter import CONFIG, WEIGHTS, NotServable, peft_view


def _trained(tmp_path: Path) -> tuple[torch.nn.Module, Path, Path]:
    """A tiny llama with LoRA: its final adapter saved, then its weights moved on and checkpointed."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config.vocab_size = 64
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    model = get_peft_model(LlamaForCausalLM(config), lora)
    final = tmp_path / "adapter"
    model.save_pretrained(final, safe_serialization=True)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))  # the checkpoint differs from the final adapter
    ckpt = tmp_path / "checkpoints" / "step-00000010"
    ckpt.mkdir(parents=True)
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    save_file(trainable, ckpt / "adapter.safetensors")
    return model, final, ckpt


def test_the_view_loads_in_peft_with_the_checkpoints_weights(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    model, final, ckpt = _trained(tmp_path)
    view = peft_view(ckpt, final, tmp_path / "views" / "step-00000010")
    assert sorted(p.name for p in view.iterdir()) == [CONFIG, WEIGHTS]
    assert (view / CONFIG).read_bytes() == (final / CONFIG).read_bytes()
    assert load_file(view / WEIGHTS).keys() == load_file(final / WEIGHTS).keys()

    base = LlamaForCausalLM(model.get_base_model().config)
    loaded = PeftModel.from_pretrained(base, view)
    want = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    got = {n: p for n, p in loaded.named_parameters() if ".lora_" in n}
    assert want.keys() == got.keys() and want
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_made_once_even_by_writers_at_once(tmp_path: Path) -> None:
    _, final, ckpt = _trained(tmp_path)
    dest = tmp_path / "views" / "step-00000010"
    errors: list[BaseException] = []

    def make() -> None:
        try:
            peft_view(ckpt, final, dest)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=make) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(p.name for p in dest.parent.iterdir()) == [dest.name]  # no temp dirs left
    before = (dest / WEIGHTS).stat().st_mtime_ns
    assert peft_view(ckpt, final, dest) == dest and (dest / WEIGHTS).stat().st_mtime_ns == before


def test_a_pruned_checkpoint_or_a_mismatch_is_refused(tmp_path: Path) -> None:
    _, final, ckpt = _trained(tmp_path)
    # copies: safetensors 0.4.3 (the floor) hands back tensors on the file's mmap, which rewriting it breaks
    weights = {k: v.clone() for k, v in load_file(ckpt / "adapter.safetensors").items()}
    name = next(iter(weights))
    save_file({k: v for k, v in weights.items() if k != name}, ckpt / "adapter.safetensors")
    with pytest.raises(NotServable, match="lacks 1 of the adapter's tensors"):
        peft_view(ckpt, final, tmp_path / "a")
    save_file({**weights, name: torch.zeros(3, 3)}, ckpt / "adapter.safetensors")
    with pytest.raises(NotServable, match=r"\[3, 3\]"):
        peft_view(ckpt, final, tmp_path / "b")
    (ckpt / "adapter.safetensors").unlink()
    with pytest.raises(FileNotFoundError):
        peft_view(ckpt, final, tmp_path / "c")
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
