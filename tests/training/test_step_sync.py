"""A step reads its loss from the device once, not once per micro-batch: on a GPU each `.item()` (or
`float()` of a device tensor) waits for every queued kernel, so reading per micro-batch serialises the
host with the device. On the CPU a read is counted instead of timed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.training.test_loop import make_parts
from tests.training.util import qa_rows, write_jsonl
from training.data import collate, load_dataset
from training.objectives.sft.loss import TokenLoss
from training.step import accumulate_gradients


def test_accumulation_reads_nothing_back_from_the_device(
    tiny_model: Path, tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    items, _ = load_dataset(write_jsonl(tmp_path / "d.jsonl", qa_rows(4)), tokenizer, 128)
    micro_batches = [collate([t], 0) for t in items]
    parts = make_parts(tiny_model)
    total = sum(t.num_targets for t in items)

    reads: list[str] = []
    for name in ("item", "__float__", "tolist"):
        original = getattr(torch.Tensor, name)

        def counting(self: torch.Tensor, *a: object, _name: str = name, _f=original) -> object:
            reads.append(_name)
            return _f(self, *a)

        monkeypatch.setattr(torch.Tensor, name, counting)
    loss = accumulate_gradients(parts, micro_batches, TokenLoss(parts, total))
    monkeypatch.undo()

    assert reads == [], f"{len(reads)} device reads in one step's accumulation: {reads[:8]}"
    assert isinstance(loss, torch.Tensor) and loss.requires_grad is False
    assert float(loss) > 0
