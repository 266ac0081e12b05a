"""training.lora_add: each LoRA update added inside its GEMM computes what peft's forward computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.spec import JobSpec
from training import lora_add
from training.model import load_model


def loss_and_grads(tiny_model: Path, fused: bool, autocast: bool, dropout: float = 0.0):
    """One forward and backward of the tiny model with LoRA (lora_B drawn, so the update is not zero)."""
    spec = JobSpec(base_model="tiny", dataset_id="testdata01", lora_dropout=dropout)
    torch.manual_seed(0)
    model = load_model(spec, tiny_model, torch.device("cpu"))
    if not fused:  # peft's own forward back on every layer
        for module in model.modules():
            module.__dict__.pop("forward", None)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    ids = torch.randint(1, 1000, (2, 40), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # the same dropout masks
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and len(a) == 2 * 2 * 7  # lora_A and lora_B of 7 linears in 2 layers
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in a)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fp32_loss_and_gradients_equal_peft(tiny_model: Path, dropout: float) -> None:
    loss, grads = loss_and_grads(tiny_model, fused=True, autocast=False, dropout=dropout)
    peft_loss, peft_grads = loss_and_grads(tiny_model, fused=False, autocast=False, dropout=dropout)
    assert float(loss) == pytest.approx(float(peft_loss), rel=1e-6)
    assert relative(grads, peft_grads) < 1e-5


def test_under_bf16_autocast_it_is_as_close_to_fp32_as_peft(tiny_model: Path) -> None:
    """Rounded once in the GEMM instead of after each of lora_B, the scaling and the add: as near the
    fp32 result as peft's bf16 forward is (within a factor of 2: both are bf16 rounding)."""
    exact_loss, exact = loss_and_grads(tiny_model, fused=False, autocast=False)
    loss, grads = loss_and_grads(tiny_model, fused=True, autocast=True)
    peft_loss, peft_grads = loss_and_grads(tiny_model, fused=False, autocast=True)
    assert abs(float(loss - exact_loss)) < max(2 * abs(float(peft_loss - exact_loss)), 1e-3)
    assert relative(grads, exact) < 2 * relative(peft_grads, exact) < 0.05


def test_installed_on_every_plain_lora_linear_and_peft_takes_what_it_does_not_cover(tiny_model: Path) -> None:
    spec = JobSpec(base_model="tiny", dataset_id="testdata01", lora_dropout=0.0)
    model = load_model(spec, tiny_model, torch.device("cpu"))
    fused = [m for m in model.modules() if "forward" in m.__dict__]
    assert len(fused) == 2 * 7
    assert lora_add.install(model) == 2 * 7  # idempotent: the same forward again
    ids = torch.randint(1, 1000, (1, 12))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.5)
        with model.disable_adapter():  # the reference policy's path: peft's forward, the base alone
            base = model(input_ids=ids).logits
        tuned = model(input_ids=ids).logits
        for module in fused:  # peft's own forward
            module.__dict__.pop("forward")
        assert torch.allclose(model(input_ids=ids).logits, tuned, rtol=1e-5, atol=1e-5)
        with model.disable_adapter():
            assert torch.equal(model(input_ids=ids).logits, base)
    assert not torch.allclose(base, tuned, rtol=1e-3, atol=1e-3)  # the adapters do change the output


def test_where_a_linear_has_a_hook_peft_runs_the_layer(tiny_model: Path) -> None:
    """The fused forward calls the linears as functions (a module call is host time), so where one of them
    has a hook, or a global module hook is set, peft's forward runs: the hooks run where peft calls them."""
    spec = JobSpec(base_model="tiny", dataset_id="testdata01", lora_dropout=0.0)
    model = load_model(spec, tiny_model, torch.device("cpu"))
    layer = next(m for m in model.modules() if "forward" in m.__dict__)
    ids = torch.randint(1, 1000, (1, 12), generator=torch.Generator().manual_seed(3))
    seen: list[str] = []
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        handle = layer.base_layer.register_forward_hook(lambda m, i, o: (seen.append("own"), o * 2)[1])
        doubled = model(input_ids=ids).logits
        handle.remove()
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, i, o: seen.append(type(m).__name__)
        )
        model(input_ids=ids)
        handle.remove()
        assert torch.equal(model(input_ids=ids).logits, plain)
    assert seen.count("own") == 1 and not torch.allclose(doubled, plain)
    # each peft LoRA Linear (its class is named Linear too), its base, lora_A and lora_B; the lm_head
    assert seen.count("Linear") == 2 * 7 * 4 + 1
