"""`python -m training.run run.json` end to end in a subprocess, on the demo model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from core.storage import ADAPTER_DIR, CHECKPOINTS_DIR, ERROR_FILE, METRICS_FILE
from tests.training.util import qa_rows, read_jsonl
from training.checkpoint import FILES, latest_checkpoint
from training.run import EXIT_FAILED, classify_error, run

REPO = Path(__file__).resolve().parents[2]


def launch(config, tmp_path: Path) -> subprocess.Popen:
    path = tmp_path / f"{config.job_id}.json"
    path.write_text(config.model_dump_json())
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    return subprocess.Popen(
        [sys.executable, "-m", "training.run", str(path)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_run_end_to_end(make_config, demo_model: Path, tmp_path: Path) -> None:
    config = make_config(
        qa_rows(16),
        model_dir=demo_model,
        name="e2e",
        base_model="ftune-demo",
        micro_batch_size=4,
        gradient_accumulation_steps=1,
        max_steps=20,
        learning_rate=4e-3,
        lora_r=16,
        lora_alpha=32,
        warmup_steps=2,
        max_seq_len=128,
    )
    proc = launch(config, tmp_path)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log
    assert "step 20/20" in log

    out = Path(config.output_dir)
    records = read_jsonl(out / METRICS_FILE)
    assert records[0]["type"] == "start" and records[0]["total_steps"] == 20
    stats = records[0]["token_stats"]
    assert stats["count"] == 16 and stats["p50"] <= stats["p95"] <= stats["max"] <= 128
    assert stats["over_max_seq_len"] == 0 and stats["over_length"] == "truncate"
    assert records[-1]["type"] == "done" and records[-1]["step"] == 20
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 21))
    losses = [r["loss"] for r in steps]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2, losses
    assert all(r["peak_mem_bytes"] > 0 and r["tokens_per_s"] > 0 for r in steps)
    assert any(r["type"] == "checkpoint" for r in records)

    adapter_dir = out / ADAPTER_DIR
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} <= {
        p.name for p in adapter_dir.iterdir()
    }
    card = (adapter_dir / "README.md").read_text()
    assert "sha256" in card and "torch" in card and '"seed": 42' in card

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(demo_model, local_files_only=True)
    ids = torch.tensor([[0, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = base(input_ids=ids).logits
        tuned = PeftModel.from_pretrained(base, adapter_dir)
        after = tuned(input_ids=ids).logits
    assert (after - before).abs().max() > 1e-3


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_exits_3(make_config, demo_model: Path, tmp_path: Path) -> None:
    config = make_config(
        qa_rows(16), model_dir=demo_model, name="term", base_model="ftune-demo", max_steps=10_000
    )
    out = Path(config.output_dir)
    proc = launch(config, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not _count_steps(out / METRICS_FILE) >= 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 3, log

    records = read_jsonl(out / METRICS_FILE)
    last_step = max(r["step"] for r in records if r["type"] == "step")
    assert records[-2] == {"type": "checkpoint", "step": last_step, "path": records[-2]["path"]}
    assert records[-1] == {"type": "stopped", "step": last_step}
    ckpt = latest_checkpoint(out / CHECKPOINTS_DIR)
    assert ckpt is not None and ckpt.name == f"step-{last_step:08d}"
    assert all((ckpt / f).is_file() for f in FILES)
    assert not (out / ADAPTER_DIR).exists()
    assert not list((out / CHECKPOINTS_DIR).glob(".tmp-*"))


def _count_steps(path: Path) -> int:
    if not path.is_file():
        return 0
    return sum('"type":"step"' in line for line in path.read_text().splitlines())


def test_invalid_dataset_writes_error_json(make_config) -> None:
    config = make_config([{"prompt": "word " * 200, "completion": "x"}], name="bad", max_seq_len=16)
    assert run(config) == EXIT_FAILED
    error = json.loads((Path(config.output_dir) / ERROR_FILE).read_text())
    assert error["code"] == "invalid_dataset" and "max_seq_len" in error["message"]


def test_missing_model_is_a_training_error(make_config, tmp_path: Path) -> None:
    config = make_config(model_dir=tmp_path / "nowhere", name="nomodel")
    assert run(config) == EXIT_FAILED
    assert json.loads((Path(config.output_dir) / ERROR_FILE).read_text())["code"] == "training_error"


def test_error_codes() -> None:
    assert classify_error(torch.OutOfMemoryError("CUDA out of memory"))[0] == "out_of_memory"
    assert classify_error(MemoryError())[0] == "out_of_memory"
    assert classify_error(RuntimeError("boom")) == ("training_error", "RuntimeError: boom")


def test_a_real_cpu_allocation_failure_is_out_of_memory() -> None:
    with pytest.raises(RuntimeError) as failed:
        torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: the allocator refuses it
    assert classify_error(failed.value)[0] == "out_of_memory"


def test_training_does_not_import_service_packages() -> None:
    modules = (
        "training.run, training.recipe, training.step, training.checkpoint, training.model, training.data, "
        "training.memory, training.batches, training.dropout, training.export, training.evaluate"
    )
    code = f"import sys, {modules}; print(' '.join(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    mods = {m.split(".")[0] for m in proc.stdout.split()}
    assert "torch" in mods and not mods & {"fastapi", "celery", "sqlalchemy", "api", "worker", "models"}
