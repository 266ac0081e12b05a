"""LoRA dropout masks belong to examples, not to micro-batches: an example gets the same mask in any
micro-batch, row or position, padded or packed; recomputation (gradient checkpointing) draws it again."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from core.spec import JobSpec
from tests.training.util import qa_rows, write_jsonl
from training import dropout
from training.data import Tokenized, collate, load_dataset
from training.model import load_model, trainable_parameters
from training.objectives.sft.loss import TokenLoss
from training.packing import collate_packed
from training.step import Parts, accumulate_gradients, count_targets, make_optimizer

KEY = (42, 0)  # (seed, epoch)


def items(*lengths: int) -> list[Tokenized]:
    return [Tokenized([1] * n, [1] * n) for n in lengths]


def apply(d: dropout.ExampleDropout, x: torch.Tensor, where: dropout.Layout) -> torch.Tensor:
    d.layout = where
    try:
        return d(x)
    finally:
        d.layout = None


@pytest.mark.parametrize("packing", [False, True])
def test_an_example_gets_its_mask_wherever_it_sits(packing: bool) -> None:
    s = JobSpec(base_model="tiny", dataset_id="testdata01", packing=packing, lora_dropout=0.3)
    xs = items(5, 3, 7)
    d = dropout.ExampleDropout(0.3, index=4).train()
    feats = torch.ones(1, 7, 16)

    def out(order: list[int], *, key: tuple[int, int] = KEY) -> dict[int, torch.Tensor]:
        """Each example's output, from a micro-batch of `order`."""
        where = dropout.layout(s, xs, order, key)
        if packing:
            y = apply(d, torch.ones(1, sum(len(xs[i].input_ids) for i in order), 16), where)[0]
            ends = torch.tensor([len(xs[i].input_ids) for i in order]).cumsum(0).tolist()
            return {i: y[e - len(xs[i].input_ids) : e] for i, e in zip(order, ends, strict=True)}
        y = apply(d, feats.expand(len(order), -1, -1).clone(), where)
        return {i: y[r, : len(xs[i].input_ids)] for r, i in enumerate(order)}

    together, alone, reversed_ = out([0, 1, 2]), out([1]), out([2, 1, 0])
    for i in (0, 1, 2):
        torch.testing.assert_close(together[i], reversed_[i], rtol=0, atol=0)
    torch.testing.assert_close(together[1], alone[1], rtol=0, atol=0)
    dropped = (together[2] == 0).float().mean()
    assert 0.15 < dropped < 0.45  # p = 0.3 over 7 x 16 values
    assert together[2].unique().tolist() == [0.0, pytest.approx(1 / 0.7)]  # kept values are scaled
    assert not torch.equal(together[2], out([0, 1, 2], key=(42, 1))[2])  # a new epoch, a new mask
    other = dropout.ExampleDropout(0.3, index=5).train()
    other.layout = dropout.layout(s, xs, [2], KEY)
    assert not torch.equal(together[2], other(torch.ones(1, 7, 16))[0])  # each module its own
    assert torch.equal(d.eval()(feats), feats)  # evaluation: no dropout


def masks(module: int, p: float, lengths: list[int], features: int) -> torch.Tensor:
    """A packed row's dropped positions (bool, [tokens, features]) from module `module`."""
    s = JobSpec(base_model="tiny", dataset_id="testdata01", packing=True, lora_dropout=p)
    xs = items(*lengths)
    d = dropout.ExampleDropout(p, index=module).train()
    return apply(d, torch.ones(1, sum(lengths), features), dropout.layout(s, xs, range(len(xs)), KEY))[0] == 0


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_the_hashed_masks_drop_p_without_correlations(p: float) -> None:
    a, b = masks(0, p, [64] * 16, 256), masks(1, p, [64] * 16, 256)  # 262,144 values each

    def corr(u: torch.Tensor, v: torch.Tensor) -> float:
        return float(torch.corrcoef(torch.stack([u.flatten().float(), v.flatten().float()]))[0, 1])

    assert abs(a.float().mean() - p) < 0.005
    assert (a.float().mean(0) - p).abs().max() < 0.1  # every feature (1,024 draws)
    assert (a.float().mean(1) - p).abs().max() < 0.25  # every token (256 draws)
    for u, v in [
        (a[:, 1:], a[:, :-1]),  # neighbouring features
        (a[1:], a[:-1]),  # neighbouring tokens
        (a[64:], a[:-64]),  # the same position in the next example
        (a, b),  # the same token and feature in two modules
    ]:
        assert abs(corr(u, v)) < 0.01


def test_a_micro_batch_mask_takes_the_same_ops_whatever_its_examples() -> None:
    """No loop over examples and no read back to the host in the forward: 40 examples of 2 tokens
    make the ops 2 examples of 40 make; and the forward runs on the meta device, which has no values
    (an .item(), .tolist() or .cpu() there raises: on a GPU each would be a host sync)."""
    s = JobSpec(base_model="tiny", dataset_id="testdata01", packing=True, lora_dropout=0.1)
    d = dropout.ExampleDropout(0.1, index=3).train()

    def ops(lengths: list[int]) -> Counter[str]:
        xs = items(*lengths)
        where = dropout.layout(s, xs, range(len(xs)), KEY)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):  # the first makes the tokens' keys; every module after it reuses them
                apply(d, torch.ones(1, 80, 32), where)
        return Counter(e.name for e in prof.events())

    ops([80])  # the features' keys, made once per process
    few, many = ops([40, 40]), ops([2] * 40)
    assert few == many
    assert not {"aten::item", "aten::_local_scalar_dense"} & set(few)
    where = dropout.layout(s, items(5, 3, 7), [0, 1, 2], KEY)
    y = apply(d, torch.ones(1, 15, 16, device="meta"), where)
    assert y.shape == (1, 15, 16) and y.device.type == "meta"


def test_install_replaces_peft_dropouts(tiny_model: Path) -> None:
    s = JobSpec(base_model="tiny", dataset_id="testdata01", lora_dropout=0.1)
    model = load_model(s, tiny_model, torch.device("cpu"))
    found = [m for m in model.modules() if isinstance(m, dropout.ExampleDropout)]
    assert len(found) == 2 * 7  # every LoRA linear of 2 layers
    assert not [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p == 0.1]
    assert sorted(m.index for m in found) == list(range(14))


@pytest.mark.parametrize("packing", [False, True])
def test_gradient_checkpointing_recomputes_the_same_masks(
    tiny_model: Path, tokenizer, tmp_path: Path, packing: bool
) -> None:
    data, _ = load_dataset(write_jsonl(tmp_path / "d.jsonl", qa_rows(4)), tokenizer, 128)
    grads = []
    for checkpointing in (False, True):
        s = JobSpec(base_model="tiny", dataset_id="testdata01", lora_dropout=0.3, lora_r=4,
                    packing=packing, gradient_checkpointing=checkpointing)  # fmt: skip
        torch.manual_seed(0)
        model = load_model(s, tiny_model, torch.device("cpu"))
        params = [p for _, p in trainable_parameters(model)]
        with torch.no_grad():  # LoRA B starts at zero; make every LoRA weight get a gradient
            for p in params:
                p.add_(torch.randn_like(p) * 0.05)
        parts = Parts(s, model, make_optimizer(s, params), params, torch.device("cpu"))
        batch = collate_packed(data) if packing else dict(collate(data, 0))
        model.train()
        torch.manual_seed(123)  # the global RNG would differ between the two; the masks must not
        loss_fn = TokenLoss(parts, count_targets(batch))
        accumulate_gradients(parts, [batch], loss_fn, layouts=[dropout.layout(s, data, range(4), KEY)])
        grads.append([p.grad.clone() for p in params])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
