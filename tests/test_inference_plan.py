"""`ftune up`'s engine and training worker planned on one device (cli/inference.py): the engine's bound is
planner.serving's for the largest catalog model, and the training worker declares the device's
memory less that bound, so the planner never admits a job that only fits without the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.inference import MAX_ADAPTERS, MAX_LORA_RANK, engine_bound, training_devices
from core.arch import load_architecture
from core.catalog import Catalog
from core.errors import FtuneError
from planner.gpus import resolve_gpu
from planner.serving import serving_bytes
from worker.devices import declared_device

GiB, MiB = 2**30, 2**20
SMALL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}
SMALL |= {"intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
SMALL |= {"num_key_value_heads": 4, "vocab_size": 1000}
LARGE = SMALL | {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8}


def catalog(tmp_path: Path, **configs: dict[str, object]) -> Catalog:
    for name, config in configs.items():
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "config.json").write_text(json.dumps(config))
    return Catalog(tmp_path / "models", tmp_path / "no-hf-cache")


def test_the_bound_is_the_largest_catalog_models(tmp_path: Path) -> None:
    cat = catalog(tmp_path, small=SMALL, large=LARGE, odd={"model_type": "unknown-arch"})
    shape = {"max_adapters": MAX_ADAPTERS, "lora_r": MAX_LORA_RANK, "max_batch": 32, "max_batch_tokens": 2048}
    expected = serving_bytes(load_architecture(tmp_path / "models" / "large"), **shape)
    small = serving_bytes(load_architecture(tmp_path / "models" / "small"), **shape)
    assert engine_bound(cat) == expected > small > 0
    assert engine_bound(catalog(tmp_path / "empty")) == 0


def test_the_bound_follows_the_batch_the_engine_runs(tmp_path: Path) -> None:
    """FTUNE_INFERENCE_MAX_BATCH_TOKENS above a lone request's 2048 tokens: the KV cache and the prefill grow
    with it, token for token; more rows add their logits."""
    cat = catalog(tmp_path, large=LARGE)
    arch = load_architecture(tmp_path / "models" / "large")
    q_dim, kv_dim = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    kv = 2 * kv_dim * 4 * (arch.num_layers + 1)  # fp32 k and v of every layer, +1 while one grows
    prefill = (
        4 * (2 * arch.hidden_size + 2 * q_dim + 2 * kv_dim + 3 * arch.intermediate_size)
        + 4 * arch.hidden_size
    )
    per_token = kv + prefill
    assert engine_bound(cat, 8192, 32) - engine_bound(cat) == 6144 * per_token
    assert engine_bound(cat, 1024, 32) == engine_bound(cat)  # a lone request may still take 2048
    assert engine_bound(cat, 2048, 64) - engine_bound(cat) == 32 * arch.vocab_size * (4 + 3 * 4)


def test_the_training_worker_declares_the_device_less_the_bound() -> None:
    cpu = declared_device("cpu:8GiB")
    assert training_devices([cpu], GiB) == "cpu:7168MiB"
    assert declared_device("cpu:7168MiB")["memory_bytes"] == 7 * GiB  # what the worker then reports
    gpus = [{"name": "NVIDIA A100", "kind": "cuda", "memory_bytes": 80 * GiB}] * 2
    assert training_devices(gpus, 10 * GiB) == "71680MiB,81920MiB"  # the engine runs on the first
    declared = [declared_device("A100-80GB")]
    assert training_devices(declared, GiB) == f"{(resolve_gpu('A100-80GB').memory_bytes - GiB) // MiB}MiB"


def test_an_engine_that_leaves_no_room_for_training_is_refused() -> None:
    with pytest.raises(FtuneError) as e:
        training_devices([declared_device("cpu:2GiB")], int(1.5 * GiB))
    assert e.value.code == "engine_too_large" and "FTUNE_INFERENCE_URL" in e.value.message
