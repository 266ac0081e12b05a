"""A step's arithmetic: token-normalised accumulation, schedules, step counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.spec import JobSpec
from tests.training.util import qa_rows, write_jsonl
from training.batches import total_steps
from training.data import collate, load_dataset
from training.model import load_model, trainable_parameters
from training.objectives.sft.loss import TokenLoss
from training.step import Parts, accumulate_gradients, count_targets, lr_at, make_optimizer, optimizer_step


def spec(**kw) -> JobSpec:
    return JobSpec(base_model="tiny", dataset_id="testdata01", **kw)


def make_parts(tiny_model: Path, **kw) -> Parts:
    s = spec(lora_dropout=0.0, lora_r=4, max_grad_norm=1.0, packing=False, **kw)  # padded batches
    torch.manual_seed(0)
    model = load_model(s, tiny_model, torch.device("cpu"))
    params = [p for _, p in trainable_parameters(model)]
    # LoRA B starts at zero; make it non-zero so every LoRA weight gets a gradient.
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.05)
    return Parts(s, model, make_optimizer(s, params), params, torch.device("cpu"))


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_accumulation_matches_one_big_batch_on_unequal_lengths(
    tiny_model: Path, tokenizer, tmp_path: Path, method: str
) -> None:
    items, _ = load_dataset(write_jsonl(tmp_path / "d.jsonl", qa_rows(4)), tokenizer, 128)
    lengths = [len(t.input_ids) for t in items]
    targets = [t.num_targets for t in items]
    assert len(set(lengths)) == 4 and len(set(targets)) == 4  # unequal lengths and target counts

    results = []
    for micro_batches in ([collate(items, 0)], [collate([t], 0) for t in items]):
        t = make_parts(tiny_model, method=method)
        tokens = sum(count_targets(b) for b in micro_batches)
        loss = accumulate_gradients(t, micro_batches, TokenLoss(t, tokens))
        grads = [p.grad.clone() for p in t.params]
        optimizer_step(t, lr=1e-2)
        results.append((float(loss), tokens, grads, [p.detach().clone() for p in t.params]))

    (loss_a, tok_a, grads_a, w_a), (loss_b, tok_b, grads_b, w_b) = results
    assert tok_a == tok_b == sum(targets)
    assert loss_a == pytest.approx(loss_b, abs=1e-5)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-5)
    for wa, wb in zip(w_a, w_b, strict=True):
        torch.testing.assert_close(wa, wb, atol=1e-5, rtol=1e-5)


def test_total_steps() -> None:
    # 10 examples / micro 2 = 5 batches; accumulation 2 -> 3 steps an epoch (the last takes one batch)
    padded = spec(micro_batch_size=2, gradient_accumulation_steps=2, epochs=3, packing=False)
    assert total_steps(padded, [20] * 10) == 9
    assert total_steps(spec(max_steps=7, epochs=3), [20] * 10) == 7


def test_schedules() -> None:
    lin = spec(learning_rate=0.1, warmup_steps=2, lr_scheduler="linear")
    assert [lr_at(lin, s, 6) for s in range(6)] == pytest.approx([0.05, 0.1, 0.1, 0.075, 0.05, 0.025])
    cos = spec(learning_rate=0.1, lr_scheduler="cosine")
    assert lr_at(cos, 0, 4) == pytest.approx(0.1) and lr_at(cos, 2, 4) == pytest.approx(0.05)
    assert lr_at(spec(learning_rate=0.1, lr_scheduler="constant"), 5, 6) == pytest.approx(0.1)


def test_warmup_ratio_is_a_share_of_the_total_steps() -> None:
    ratio = spec(learning_rate=0.1, warmup_ratio=0.25, warmup_steps=99, lr_scheduler="linear")
    # 8 steps: 2 warmup steps (the ratio overrides warmup_steps), then linear decay over 6.
    assert [lr_at(ratio, s, 8) for s in range(4)] == pytest.approx([0.05, 0.1, 0.1, 0.5 / 6])
