"""Checkpoint retention: the newest `keep_checkpoints` plus the best by eval loss stay on disk."""

from __future__ import annotations

import json
from pathlib import Path

from training.checkpoint import best_checkpoint, checkpoint_name, list_checkpoints, prune


def _fake(root: Path, step: int, best_eval_loss: float | None) -> None:
    d = root / checkpoint_name(step)
    d.mkdir(parents=True)
    (d / "state.json").write_text(json.dumps({"position": {"step": step, "best_eval_loss": best_eval_loss}}))


def steps(root: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in list_checkpoints(root)]


def test_keeps_the_newest_n_and_the_best_by_eval_loss(tmp_path: Path) -> None:
    # The eval loss improved until step 20 (best 0.5), then got worse: best_eval_loss stays 0.5 after it.
    for step, best in ((10, 0.9), (20, 0.5), (30, 0.5), (40, 0.5), (50, 0.5)):
        _fake(tmp_path, step, best)
    assert best_checkpoint(list_checkpoints(tmp_path)) == tmp_path / checkpoint_name(20)
    prune(tmp_path, 2)
    assert steps(tmp_path) == [20, 40, 50]
    prune(tmp_path, 1)
    assert steps(tmp_path) == [20, 50]


def test_without_evaluation_keeps_the_newest_n(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _fake(tmp_path, step, None)
    assert best_checkpoint(list_checkpoints(tmp_path)) is None
    prune(tmp_path, 3)
    assert steps(tmp_path) == [2, 3, 4]
    (tmp_path / ".tmp-step-00000005-x").mkdir()  # left by a process killed mid-write
    prune(tmp_path, 3)
    assert not list(tmp_path.glob(".tmp-*"))


def test_the_best_among_the_newest_costs_no_extra_slot(tmp_path: Path) -> None:
    for step, best in ((1, 0.9), (2, 0.8), (3, 0.7)):
        _fake(tmp_path, step, best)
    prune(tmp_path, 2)
    assert steps(tmp_path) == [2, 3]
