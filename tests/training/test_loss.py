"""The chunked loss head (training.loss) equals the plain one: the same per-token losses, argmax hits and
gradients, padded and packed, however many chunks the scored tokens are cut into."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.training.test_packing import make_trainer
from tests.training.util import qa_rows, write_jsonl
from training import loss as loss_module
from training.data import IGNORE, Tokenized, collate, load_dataset, scored_targets
from training.loss import token_losses
from training.packing import collate_packed


@pytest.fixture
def items(tokenizer, tmp_path: Path) -> list[Tokenized]:
    items, _ = load_dataset(write_jsonl(tmp_path / "d.jsonl", qa_rows(5)), tokenizer, 96)
    return items


def _model(tiny_model: Path, items, packing: bool):
    parts = make_trainer(tiny_model, items, packing=packing)  # every LoRA weight nonzero: all get gradients
    return parts.model, parts.params


def _run(model, params, batch, fused: bool):
    for p in params:
        p.grad = None
    losses, hits = token_losses(model, batch, torch.device("cpu"), fused=fused)
    # unequal weights per token, as DPO's per-sequence sums give: backward must scale row by row
    weights = torch.linspace(0.5, 1.5, len(losses))
    (losses * weights).sum().backward()
    return losses.detach(), int(hits), [p.grad.clone() for p in params]


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("chunk", [3, 10_000])
def test_chunked_head_equals_the_plain_head(
    tiny_model: Path, items, packing: bool, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, params = _model(tiny_model, items, packing)
    batch = collate_packed(items) if packing else collate(items, 0)
    monkeypatch.setattr(loss_module, "loss_chunk_tokens", lambda vocab: chunk)
    want_losses, want_hits, want_grads = _run(model, params, batch, fused=False)
    got_losses, got_hits, got_grads = _run(model, params, batch, fused=True)
    assert len(got_losses) == sum(t.num_targets for t in items)
    torch.testing.assert_close(got_losses, want_losses, atol=1e-5, rtol=1e-5)
    assert got_hits == want_hits
    for got, want in zip(got_grads, want_grads, strict=True):
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_plain_head_is_the_model_s_own_logits(tiny_model: Path, items) -> None:
    """The reference itself: the cross-entropy of the logits the model returns, at the scored positions."""
    model, _ = _model(tiny_model, items, packing=False)
    batch = collate(items, 0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        want = torch.nn.functional.cross_entropy(
            logits[labels != IGNORE], labels[labels != IGNORE], reduction="none"
        )
        got, _ = token_losses(model, batch, torch.device("cpu"), fused=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_scored_targets_are_made_on_the_host_in_row_major_order() -> None:
    labels = torch.tensor([[IGNORE, 5, 6, IGNORE], [IGNORE, IGNORE, 7, IGNORE]])
    t = scored_targets(labels, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    # position p is scored when labels[p + 1] is: (0,0)->5, (0,1)->6, (1,1)->7
    assert t["target_index"].tolist() == [0, 1, 5]
    assert t["target_labels"].tolist() == [5, 6, 7]
    assert t["target_sequence"].tolist() == [0, 0, 1]
    assert all(v.device.type == "cpu" for v in t.values())
