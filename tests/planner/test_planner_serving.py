"""The inference engine's memory bound (planner.serving): terms by hand, and >= what the engine holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.arch import from_config
from planner.serving import adapter_bytes, max_resident_adapters, serving_bytes, serving_terms
from tests.planner.planner_util import LLAMA3_8B


def test_terms_by_hand_for_llama3_8b() -> None:
    arch = from_config(LLAMA3_8B)
    terms, total = serving_terms(arch, max_adapters=8, lora_r=16, lora_targets="all-linear", max_seq_len=4096)
    by = {t.name: t.bytes for t in terms}
    assert total == sum(by.values())
    assert by["base weights"] == arch.total_params * 2 + 128 * 4  # bf16 (config.json's) + rotary buffers
    # per layer: q 4096->4096, k, v 4096->1024, o 4096->4096, gate/up 4096->14336, down 14336->4096
    per_layer = 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 2 + (14336 + 4096))
    assert by["LoRA adapters"] == 8 * 32 * per_layer * 4
    assert by["KV cache"] == 33 * 2 * 8 * 128 * 2 * 4096  # 32 layers + 1 growing, k and v, 8 kv heads x 128
    assert by["logits"] == 128256 * (2 + 12)
    assert 16e9 < total < 19e9  # 8B params in bf16 dominate


def test_bound_grows_with_each_input_and_adapters_fit_the_budget() -> None:
    arch = from_config(LLAMA3_8B)
    base = serving_bytes(arch, max_adapters=1, lora_r=16)
    assert serving_bytes(arch, max_adapters=2, lora_r=16) - base == adapter_bytes(arch, 16)
    assert serving_bytes(arch, max_adapters=1, lora_r=32) > base
    assert serving_bytes(arch, max_adapters=1, lora_r=16, max_batch=4) > base
    assert serving_bytes(arch, max_adapters=1, lora_r=16, max_seq_len=8192) > base
    assert serving_bytes(arch, max_adapters=1, lora_r=16, dtype="float32") > base
    fixed = serving_bytes(arch, max_adapters=0, lora_r=16)
    one = adapter_bytes(arch, 16)
    assert max_resident_adapters(arch, fixed + 3 * one + one // 2, lora_r=16) == 3
    assert max_resident_adapters(arch, fixed - 1, lora_r=16) == 0


@pytest.mark.slow
def test_bound_covers_what_the_engine_holds_and_uses_generating(tmp_path: Path) -> None:
    """The demo model (its real size) with 4 adapters in the engine: the bound >= the bytes of the model's
    parameters and buffers (storage bytes, as training.memory counts them), and >= the peak of live tensor
    bytes while a request generates (torch's profiler, as training measures a CPU step)."""
    import torch

    from core.arch import load_architecture
    from core.catalog import Catalog
    from core.data.examples import Message
    from inference.engine import Engine
    from tests.inference.conftest import save_random_adapter
    from training.decoding.sampling import Sampling
    from training.demo import build_demo_model
    from training.memory import PeakMemory, storage_bytes

    adapters = 4
    model_dir = build_demo_model(tmp_path / "models")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    engine = Engine(Catalog(tmp_path / "models", hf_cache=tmp_path / "none"), max_adapters=adapters)
    for i in range(adapters):
        engine.register(f"a{i}", str(save_random_adapter(model_dir, tmp_path / f"a{i}", i, 8, targets)))
    messages = [Message(role="user", content="Tell me about rivers and mountains. " * 8)]
    sampling = Sampling(max_tokens=32, temperature=0, ignore_eos=True)
    for i in range(adapters):
        engine.prepare(engine.resolve(f"a{i}"))  # loaded and resident
    prepared = engine.start(engine.resolve(f"a{adapters - 1}"), messages, sampling)
    model = engine.loaded_model("ftune-demo")
    held = storage_bytes([*model.parameters(), *model.buffers()])

    peak = PeakMemory(torch.device("cpu"))
    with peak.step([*model.parameters(), *model.buffers()]):
        done = engine.generate(prepared)
    assert done.tokens == 32
    assert engine.resident_adapters("ftune-demo") == [f"a{i}" for i in range(adapters)]

    arch = load_architecture(model_dir)
    seq = len(prepared.prompt) + 32
    terms, bound = serving_terms(arch, max_adapters=adapters, lora_r=8, lora_targets=targets, max_seq_len=seq)
    weights = sum(t.bytes for t in terms if t.name in ("base weights", "LoRA adapters"))
    assert weights == held  # the weight terms are exact
    assert peak.peak_bytes <= bound, (peak.peak_bytes, bound)
    print(f"{adapters} adapters: held {held:,} B, generation peak {peak.peak_bytes:,} B, bound {bound:,} B")
