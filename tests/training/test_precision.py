"""Mixed precision: one rule for the engine and the planner. bf16 autocast on a GPU with bf16, fp16
with loss scaling on one without (T4, V100), none on a CPU. The GPU's capability is injected, so the
rule is tested without such a GPU."""

from __future__ import annotations

import pytest
import torch

from core.arch import load_architecture
from core.planner.context import compute_dtype as planned_dtype
from core.planner.context import plan_context
from core.planner.gpus import GPUS, Gpu
from core.planner.types import Runtime
from core.spec import JobSpec
from training.model import compute_dtype, precision_for

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def spec(**kw) -> JobSpec:
    return JobSpec(base_model="tiny", dataset_id="testdata01", **kw)


@pytest.mark.parametrize(
    ("mode", "device", "bf16", "dtype"),
    [
        ("auto", CUDA, True, torch.bfloat16),  # A100, H100, L4, ...
        ("auto", CUDA, False, torch.float16),  # T4, V100: no bf16
        ("auto", CPU, False, None),
        ("bf16", CUDA, True, torch.bfloat16),
        ("bf16", CPU, False, torch.bfloat16),  # asked for: CPU autocast has bf16
        ("fp16", CUDA, True, torch.float16),
        ("no", CUDA, True, None),
    ],
)
def test_the_rule(mode: str, device: torch.device, bf16: bool, dtype: torch.dtype | None) -> None:
    p = precision_for(spec(mixed_precision=mode), device, bf16)
    assert p.dtype == dtype
    assert p.scaled == (dtype == torch.float16)  # fp16 gradients underflow without a GradScaler


def test_qlora_computes_in_the_gpus_half_dtype() -> None:
    assert compute_dtype(CUDA, bf16=True) == torch.bfloat16
    assert compute_dtype(CUDA, bf16=False) == torch.float16
    assert compute_dtype(CPU, bf16=False) == torch.float32


@pytest.mark.parametrize("mode", ["auto", "bf16", "fp16", "no"])
def test_the_planner_plans_what_the_engine_runs_on_every_known_gpu(tiny_model, mode: str) -> None:
    arch = load_architecture(tiny_model)
    for gpu in [*GPUS.values(), Gpu(name="cpu", memory_bytes=2**34, bf16_supported=False, kind="cpu")]:
        device = CPU if gpu.kind == "cpu" else CUDA
        for method, stored in [("lora", "float32"), ("lora", "bfloat16"), ("qlora", "auto")]:
            s = spec(mixed_precision=mode, method=method, torch_dtype=stored)
            engine = precision_for(s, device, gpu.bf16_supported)
            ctx = plan_context(s, arch, gpu, Runtime())
            assert ctx.autocast == (engine.dtype is not None), (gpu.name, method)
            if engine.dtype is not None:
                assert planned_dtype(s, arch, gpu) == str(engine.dtype).removeprefix("torch."), gpu.name
            if method == "qlora":  # the unquantized layers load in QLoRA's compute dtype
                want = compute_dtype(device, gpu.bf16_supported)
                assert ctx.store == str(want).removeprefix("torch."), gpu.name


def test_autocast_casts_to_the_chosen_dtype_on_a_cpu() -> None:
    a = torch.randn(4, 4)
    with precision_for(spec(mixed_precision="bf16"), CPU, False).autocast():
        assert (a @ a).dtype == torch.bfloat16
    with precision_for(spec(mixed_precision="auto"), CPU, False).autocast():
        assert (a @ a).dtype == torch.float32
