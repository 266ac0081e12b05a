"""The demo model: offline-loadable, deterministic, idempotent, with a chat template."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from training.demo import TINY, build_demo_model


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_demo_model_loads_offline(demo_model: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(demo_model, local_files_only=True)
    assert config.model_type == "llama" and config.num_key_value_heads < config.num_attention_heads
    assert not config.tie_word_embeddings and config.max_position_embeddings == 2048
    assert (demo_model / "model.safetensors").is_file()
    tok = AutoTokenizer.from_pretrained(demo_model, local_files_only=True)
    assert tok.bos_token and tok.eos_token and tok.pad_token
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    model = AutoModelForCausalLM.from_pretrained(demo_model, local_files_only=True)
    assert 3_000_000 < sum(p.numel() for p in model.parameters()) < 10_000_000
    assert tok.decode(tok("How do I boil an egg?")["input_ids"]) == "How do I boil an egg?"


def test_demo_build_is_deterministic_and_idempotent(tmp_path: Path, tiny_model: Path) -> None:
    start = time.monotonic()
    again = build_demo_model(tmp_path, name="tiny", size=TINY)
    assert time.monotonic() - start < 20
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert digest(again / name) == digest(tiny_model / name), name
    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert build_demo_model(tmp_path, name="tiny", size=TINY) == again  # already there: untouched
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left
