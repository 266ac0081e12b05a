"""training.compiled: decoder layers compiled for the training step alone, where it was measured to pay, and
back to their own code when torch.compile fails. On a CPU with dynamo's counting backend (the graphs run
eagerly): what is traced and when, not inductor's kernels (bench/gpu_vs_trl.py times those on a GPU)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from core.spec import JobSpec
from training import compiled, distributed
from training.demo import TINY, build_demo_model
from training.model import load_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test traces anew: dynamo caches what it compiled by code object, across models."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def spec(**kw) -> JobSpec:
    return JobSpec(base_model="tiny", dataset_id="testdata01", lora_dropout=0.0, **kw)


def test_compiled_only_where_measured() -> None:
    assert compiled.why_not_compiled(spec(), CUDA, sharded=False) is None
    assert compiled.why_not_compiled(spec(), CPU, sharded=False) == "not CUDA"
    assert "qlora" in (compiled.why_not_compiled(spec(method="qlora"), CUDA, sharded=False) or "")
    assert "dpo" in (compiled.why_not_compiled(spec(objective="dpo"), CUDA, sharded=False) or "")
    assert "padded" in (compiled.why_not_compiled(spec(packing=False), CUDA, sharded=False) or "")
    checkpointing = spec(gradient_checkpointing=True)
    assert "checkpointing" in (compiled.why_not_compiled(checkpointing, CUDA, sharded=False) or "")
    assert "FSDP" in (compiled.why_not_compiled(spec(), CUDA, sharded=True) or "")
    assert "turned off" in (compiled.why_not_compiled(spec(), CUDA, sharded=False, wanted=False) or "")
    assert compiled.compile_layers(torch.nn.Linear(2, 2), spec(), CPU, sharded=False) == "none (not CUDA)"


@pytest.fixture(scope="module")
def four_layers(models_dir: Path) -> Path:
    """The tiny model with 4 decoder layers: whether they share one graph shows."""
    return build_demo_model(models_dir, name="tiny4", size=replace(TINY, num_layers=4))


def _models(model_dir: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model twice, the same LoRA init (lora_B non-zero, so the adapters carry gradient)."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = load_model(spec(), model_dir, CPU)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
        models.append(model)
    return models[0], models[1]


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_training_step_runs_compiled_and_no_grad_calls_their_own_code(four_layers: Path) -> None:
    plain, fast = _models(four_layers)
    counter = CompileCounter()
    layers = distributed.decoder_layers(fast)
    for layer in layers:
        compiled.compile_for_training(layer, backend=counter)

    for length in (48, 31):  # another length: the same graph (dynamic shapes)
        ids = torch.randint(1, 1000, (2, length))
        loss, grads = _loss_and_grads(plain, ids)
        loss_fast, grads_fast = _loss_and_grads(fast, ids)
        assert torch.equal(loss, loss_fast)
        assert grads.keys() == grads_fast.keys() and len(grads) == 4 * 2 * 7
        assert all(torch.equal(grads[n], grads_fast[n]) for n in grads)
    # Two graphs for the four layers, whatever the length: the first layer's (its input, the frozen
    # embedding, needs no gradient) and the others'; no graph break (one graph a call), no recompile.
    assert counter.frame_count == 2

    with torch.no_grad():  # evaluation, a reference pass, sampling: the layers' own code
        ids = torch.randint(1, 1000, (2, 20))
        assert torch.equal(plain(input_ids=ids).logits, fast(input_ids=ids).logits)
    assert counter.frame_count == 2


def test_a_failing_compile_falls_back_to_the_layers_own_code(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        raise RuntimeError("no compiler here")

    plain, fast = _models(tiny_model)
    for layer in distributed.decoder_layers(fast):
        compiled.compile_for_training(layer, backend=broken)
    for _ in range(2):
        ids = torch.randint(1, 1000, (2, 24))
        loss, grads = _loss_and_grads(plain, ids)
        loss_fast, grads_fast = _loss_and_grads(fast, ids)
        assert torch.equal(loss, loss_fast)
        assert all(torch.equal(grads[n], grads_fast[n]) for n in grads)
    failures = [r for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(failures) == 2  # once for each of the tiny model's layers, then never tried again
