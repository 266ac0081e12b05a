"""bench/gpu_vs_trl.py's smoke: without CUDA (or with --smoke) it trains its runs (ftune packed and padded
through training.run, TRL's SFTTrainer packed and padded, and with --eager-layers "ftune eager": the A/B
of the decoder layers the engine compiles on a GPU alone, here its plumbing) on a tiny model and prints
them side by side, with a JSON line. trl is a dev-only dependency (pinned in pyproject.toml)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.stack import REPO

pytestmark = pytest.mark.slow
pytest.importorskip("trl")

RUNS = ["ftune packed", "trl packed", "ftune eager", "ftune padded", "trl padded"]


def test_smoke_trains_all_runs_and_prints_them_side_by_side(tmp_path: Path) -> None:
    result_file = tmp_path / "result.json"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "gpu_vs_trl.py"),
        "--smoke",
        "--eager-layers",
        "--keep",
        str(tmp_path),
    ]
    done = subprocess.run([*cmd, "--json-out", str(result_file)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    result = json.loads(result_file.read_text())
    assert result["smoke"] is True
    assert [r["run"] for r in result["runs"]] == RUNS
    for r in result["runs"]:
        assert r["exit"] == 0, r
        assert r["steps_done"] == 3, r
        assert r["timed_steps"] == 2, r  # step 1 is left out
        assert r["tokens_per_s"] > 0, r
        assert r["final_loss"] is not None and math.isfinite(r["final_loss"]), r
    # The same LoRA on the same model: the same trainable parameters on both sides.
    assert len({r["trainable_params"] for r in result["runs"]}) == 1
    # TRL packed is padding-free; padded micro-batches carry padding, never counted as tokens.
    trl = {r["run"]: r for r in result["runs"] if r["engine"] == "trl"}
    assert trl["trl packed"]["padding_share"] == 0
    assert 0 < trl["trl padded"]["padding_share"] < 1

    # The table: one row per run, its tokens/s (the 4th column) positive.
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("run ") and "tok/s" in line)
    table = {line[:14].strip(): line[14:].split() for line in lines[header + 1 : header + 1 + len(RUNS)]}
    assert list(table) == RUNS
    for cells in table.values():
        assert cells[0] == "0" and float(cells[2]) > 0, cells
    assert any(line.startswith("ftune best / TRL best:") for line in lines)
    # Each run's engine says what it compiled: on a CPU nothing, and the eager run because it was told so;
    # no torch.compile counts then (a run reports them where it made graphs).
    logs = {run: (tmp_path / run.replace(" ", "-") / "log.txt").read_text() for run in RUNS if "ftune" in run}
    assert "compiled: none (not CUDA)" in logs["ftune packed"]
    assert "compiled: none (turned off" in logs["ftune eager"]
    assert not any(r.get("compiled") for r in result["runs"])
    assert not any("torch.compile made" in line for line in lines)
    assert json.loads(lines[-1]) == result
