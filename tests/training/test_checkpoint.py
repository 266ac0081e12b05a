"""Checkpoint files: atomic, complete or absent, the newest K kept."""

from __future__ import annotations

from pathlib import Path

import torch

from core.spec import JobSpec
from training.checkpoint import (
    FILES,
    KEEP,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from training.step import Parts, Position


def trainer() -> Parts:
    model = torch.nn.Linear(4, 3)
    params = list(model.parameters())
    spec = JobSpec(base_model="tiny", dataset_id="testdata01")
    return Parts(spec, model, torch.optim.AdamW(params), params, torch.device("cpu"))


def test_keeps_the_newest_and_resumes_from_the_newest_complete(tmp_path: Path) -> None:
    t = trainer()
    for step in range(1, 6):
        save_checkpoint(tmp_path, t, Position(step=step, epoch=step // 2, step_in_epoch=step % 2), 100)
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"step-{s:08d}" for s in (3, 4, 5)][-KEEP:]
    (tmp_path / "step-00000005" / FILES[1]).unlink()  # damaged
    (tmp_path / ".tmp-step-00000006-x").mkdir()  # a writer killed mid-way
    newest = latest_checkpoint(tmp_path)
    assert newest is not None and newest.name == "step-00000004"
    pos = load_checkpoint(newest, trainer())
    assert (pos.step, pos.epoch, pos.step_in_epoch) == (4, 2, 0)
    # Saving step 5 again replaces the damaged one; the stale temp dir is cleaned up.
    save_checkpoint(tmp_path, t, Position(step=5), 100)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000005"
    assert not list(tmp_path.glob(".tmp-*"))


def test_restores_weights_and_rng(tmp_path: Path) -> None:
    t = trainer()
    torch.manual_seed(3)
    path = save_checkpoint(tmp_path, t, Position(step=1, losses=[2.5]), 100)
    expected_draw = torch.rand(3)
    other = trainer()
    pos = load_checkpoint(path, other)
    assert pos.losses == [2.5]
    torch.testing.assert_close(other.model.weight, t.model.weight, rtol=0, atol=0)
    torch.testing.assert_close(torch.rand(3), expected_draw, rtol=0, atol=0)
