"""bench/gpu_vs_trl.py's smoke: without CUDA (or with --smoke) it trains its runs (ftune packed and padded
through training.run; TRL's SFTTrainer as configured by default, packed and padded; "trl fastest" and
"trl fastest bf16", TRL's fastest configuration, whose Liger and torch_compile a CPU skips, each with its
reason; Unsloth, which does not import here and says so; with --eager-layers "ftune eager": the A/B of the
decoder layers the engine compiles on a GPU alone, here its plumbing) on a tiny model and prints them side
by side, each with what it ran, with a JSON line. trl is a dev-only dependency (pinned in pyproject.toml)."""

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

RUNS = ["ftune packed", "trl packed", "ftune eager", "trl fastest", "trl fastest bf16", "unsloth",
        "ftune padded", "trl padded"]  # fmt: skip
TRAINED = [r for r in RUNS if r != "unsloth"]
WIDTH = max(len(r) for r in RUNS) + 1  # the table's run column (race.NAME_WIDTH: "trl fastest sdpa")


def smoke(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    result_file = tmp_path / "result.json"
    cmd = [sys.executable, str(REPO / "bench" / "gpu_vs_trl.py"), "--smoke", "--keep", str(tmp_path), *args]
    done = subprocess.run([*cmd, "--json-out", str(result_file)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(result_file.read_text())
    assert json.loads(done.stdout.splitlines()[-1]) == result
    return done, result


def table(stdout: str, names: list[str]) -> dict[str, list[str]]:
    """The table's rows by run: the cells after the run's name."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("run ") and "tok/s" in line)
    assert "MFU 6N" in lines[header] and "MFU LoRA" in lines[header] and "check" in lines[header]
    rows = lines[header + 1 : header + 1 + len(names)]
    return {line[:WIDTH].strip(): line[WIDTH:].split() for line in rows}


def test_smoke_trains_all_runs_and_prints_them_side_by_side(tmp_path: Path) -> None:
    done, result = smoke(tmp_path, "--eager-layers")
    assert result["smoke"] is True and result["method"] == "lora"
    assert [r["run"] for r in result["runs"]] == RUNS
    runs = {r["run"]: r for r in result["runs"]}
    for name in TRAINED:
        r = runs[name]
        assert r["exit"] == 0, r
        assert r["steps_done"] == 3, r
        assert r["timed_steps"] == 2, r  # step 1 is left out (--warmup: 1 in the smoke)
        assert r["tokens_per_s"] > 0, r
        assert r["final_loss"] is not None and math.isfinite(r["final_loss"]), r
        assert r["loss_check"] in ("ok", "reference"), r  # the same losses within noise as TRL's default
        assert r["mfu_6n"] is None and r["mfu_lora"] is None  # no GPU peak on a CPU: no MFU
    assert runs["trl packed"]["loss_check"] == runs["trl padded"]["loss_check"] == "reference"
    # The same LoRA on the same model: the same trainable parameters on every side.
    assert len({runs[name]["trainable_params"] for name in TRAINED}) == 1
    # TRL packed is padding-free; padded micro-batches carry padding, never counted as tokens.
    assert runs["trl packed"]["padding_share"] == runs["trl fastest"]["padding_share"] == 0
    assert 0 < runs["trl padded"]["padding_share"] < 1

    # TRL's fastest configuration: what it set, and what a CPU could not use, with the reason.
    fastest = runs["trl fastest"]["opponent"]
    assert fastest["config"]["packing"] is True and fastest["config"]["padding_free"] is True
    assert fastest["config"]["use_liger_kernel"] is False and fastest["config"]["torch_compile"] is False
    assert any(n.startswith("use_liger_kernel: skipped (no CUDA") for n in fastest["notes"]), fastest
    assert any(n.startswith("torch_compile: skipped (no CUDA") for n in fastest["notes"]), fastest
    assert "attention_choice" in fastest["used"]
    assert "lora_weights" in runs["trl fastest bf16"]["opponent"]["used"]  # its own PeftModel
    assert runs["trl fastest bf16"]["lora_dtypes"] == ["float32"]  # the base's dtype: fp32 in the smoke
    # Unsloth does not import here: the row says so and is skipped, not failed.
    assert runs["unsloth"]["exit"] is None and runs["unsloth"]["skipped"] is True
    assert runs["unsloth"]["unavailable"].startswith("ModuleNotFoundError"), runs["unsloth"]

    # Both counts of FLOPs per token: 4 N_mm + 6 N_lora + 3 x attention, and 6 N_total.
    f = result["flops"]
    assert f["n_blocks"] < f["n_matmul"] < f["n_total"]
    assert f["lora_flops_per_token"] == 4 * f["n_matmul"] + 6 * f["n_lora"] + 3 * f["attn_fwd_per_token"]
    assert f["six_n_flops_per_token"] == 6 * f["n_total"]
    assert 0 < f["attn_fwd_per_token"] < f["attn_fwd_per_token_full_square"]

    # The table: one row per run, its tokens/s (the 4th column) positive; Unsloth's row "skip".
    cells = table(done.stdout, RUNS)
    assert list(cells) == RUNS
    for name in TRAINED:
        assert cells[name][0] == "0" and float(cells[name][2]) > 0, cells[name]
    assert cells["unsloth"][0] == "skip"
    lines = done.stdout.splitlines()
    assert "  unsloth: unavailable: ModuleNotFoundError: No module named 'unsloth'" in lines
    described = [line for line in lines if line.startswith("  trl fastest: SFTConfig(")]
    assert len(described) == 1 and "use_liger_kernel=False" in described[0] and "not used:" in described[0]
    assert any(line.startswith("TRL best: trl ") for line in lines)
    assert any(line.startswith("Unsloth best: unavailable: ModuleNotFoundError") for line in lines)
    assert any(line.startswith("ftune best / opponent best:") for line in lines)
    assert result["ftune_best"].startswith("ftune") and result["trl_best"].startswith("trl")
    assert result["opponent_best"] == result["trl_best"] and result["unsloth_best"] is None
    # Each run's engine says what it compiled: on a CPU nothing, and the eager run because it was told so;
    # no torch.compile counts then (a run reports them where it made graphs).
    logs = {run: (tmp_path / run.replace(" ", "-") / "log.txt").read_text() for run in RUNS if "ftune" in run}
    assert "compiled: none (not CUDA)" in logs["ftune packed"]
    assert "compiled: none (turned off" in logs["ftune eager"]
    assert not any(r.get("compiled") for r in result["runs"])
    assert not any("torch.compile made" in line for line in lines)


def test_smoke_qlora_with_checkpointing_on_both_sides(tmp_path: Path) -> None:
    """--qlora --checkpointing: nf4 4-bit base weights and checkpointing on every side (TRL's adapters in
    bf16, as SFTTrainer casts them for a quantized base), the runs chosen with --runs, in that order."""
    names = ["ftune packed", "trl fastest", "trl packed"]
    done, result = smoke(tmp_path, "--qlora", "--checkpointing", "--runs", ",".join(names))
    assert result["method"] == "qlora" and result["checkpointing"] is True
    assert [r["run"] for r in result["runs"]] == names
    runs = {r["run"]: r for r in result["runs"]}
    for r in runs.values():
        assert r["exit"] == 0 and r["steps_done"] == 3 and r["loss_check"] in ("ok", "reference"), r
    for name in ("trl fastest", "trl packed"):
        assert runs[name]["gradient_checkpointing"] is True
        assert runs[name]["lora_dtypes"] == ["bfloat16"]
    assert len({r["trainable_params"] for r in runs.values()}) == 1
    assert list(table(done.stdout, names)) == names
    assert "method qlora" in runs["ftune packed"]["configuration"]
