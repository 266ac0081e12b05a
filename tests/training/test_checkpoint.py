"""Checkpoint files: atomic, complete or absent, the newest K kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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


def test_a_checkpoint_written_before_a_spec_field_was_added_resumes_and_another_spec_is_refused(
    tmp_path: Path,
) -> None:
    """state.json keeps the spec it was written for; a field added since (rollout_batch_size, 2026-11-27)
    takes its default, so a job paused before an upgrade resumes after it. Any other difference refuses."""
    path = save_checkpoint(tmp_path, trainer(), Position(step=1), 100)
    state_file = path / FILES[3]
    state = json.loads(state_file.read_text())

    def load_with(spec: dict) -> Position:
        state_file.write_text(json.dumps({**state, "spec": spec}))
        return load_checkpoint(path, trainer())

    older = {k: v for k, v in state["spec"].items() if k != "rollout_batch_size"}
    assert load_with(older).step == 1
    for other in ({**state["spec"], "learning_rate": 1e-3}, {**state["spec"], "since_removed": 1}):
        with pytest.raises(ValueError, match="different job spec"):
            load_with(other)
