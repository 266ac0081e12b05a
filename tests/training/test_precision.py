"""Mixed precision: one rule for the engine and the planner. bf16 autocast on a GPU with bf16, fp16
with loss scaling on one without (T4, V100), none on a CPU. The GPU's capability is injected, so the
rule is tested without such a GPU."""

from __future__ import annotations

import pytest
import torch

from core.arch import load_architecture
from core.spec import JobSpec
from planner.context import compute_dtype as planned_dtype
from planner.context import plan_context
from planner.gpus import GPUS, Gpu
from planner.types import Runtime
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


def _loss_grads_and_saved(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """One forward and backward under bf16 autocast: the loss, the adapter's gradients and the bytes of
    the distinct storages autograd saved for backward."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, sum(saved.values())


@pytest.mark.parametrize("stored", ["bfloat16", "float32"])
def test_lora_inputs_uncast_under_autocast_change_nothing_but_the_copies(tiny_model, stored) -> None:
    """training.model.skip_adapter_input_casts: peft's cast of a LoRA input to fp32, which autocast casts
    straight back, is left out: the loss and every gradient are bitwise the same, and autograd keeps less
    (bf16 weights: q/k/v and gate/up share their input; fp32 weights: o_proj and down_proj read theirs)."""
    from training.model import load_model, skip_adapter_input_casts

    s = spec(torch_dtype=stored, lora_dropout=0.0, mixed_precision="bf16")
    ids = torch.randint(1, 1000, (2, 48))
    torch.manual_seed(0)
    model = load_model(s, tiny_model, CPU)
    as_peft = _loss_grads_and_saved(model, ids)
    assert skip_adapter_input_casts(model) == 2 * 7  # 2 layers x q k v o gate up down
    as_is = _loss_grads_and_saved(model, ids)
    assert torch.equal(as_peft[0], as_is[0])
    assert as_peft[1].keys() == as_is[1].keys() and len(as_is[1]) == 2 * 2 * 7
    for name, grad in as_peft[1].items():
        assert torch.equal(grad, as_is[1][name]), name
    tokens, hidden, layers = ids.numel(), 64, 2
    # what each layer no longer keeps: bf16 copies of q/k/v's and gate/up's inputs (bf16 weights: 3 + 2 of
    # them become one each) and of o_proj's input (both), and down_proj's (fp32 weights: its own bf16 copy
    # of the bf16 product becomes the product itself, which nothing else keeps: no change)
    copies = (2 + 1 + 1) if stored == "bfloat16" else 1
    assert as_peft[2] - as_is[2] == copies * layers * tokens * hidden * 2
