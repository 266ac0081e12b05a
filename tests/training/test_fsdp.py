"""FSDP2 for real: `torchrun --nproc_per_node 2` (the worker's own command) on CPU with gloo.

18 examples of 40-64 tokens, a packed row of max_seq_len 64 each. A step's global batch is 8 rows
(micro 2 x accumulation 2 x 2 GPUs, or accumulation 4 on one process), so an epoch is steps of 8, 8
and 2 rows: 4, 4 and 1 micro-batches. In the short one rank 1 has nothing of its own and runs a
padding batch weighted 0.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.storage import ADAPTER_DIR, CHECKPOINTS_DIR, METRICS_FILE
from tests.training.util import elementwise, qa_rows, read_metrics, relative_difference, write_jsonl
from training.checkpoint import checkpoint_name, list_checkpoints
from training.run import EXIT_OK, run
from worker.runner import training_command

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# Dropout on and gradient clipping on (max_grad_norm 1.0 by default): both must agree across ranks.
FSDP = {"num_gpus": 2, "gradient_accumulation_steps": 2, "lora_dropout": 0.1, "lr_scheduler": "cosine"}


def launch(config, tmp_path: Path) -> subprocess.Popen:
    path = tmp_path / f"{config.job_id}.json"
    path.write_text(config.model_dump_json())
    cmd = training_command(path)
    assert "--nproc_per_node=2" in cmd
    return subprocess.Popen(
        cmd, cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "default"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    log, _ = proc.communicate(timeout=300)
    return proc.returncode, log


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / ADAPTER_DIR / "adapter_model.safetensors")


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def records(out: Path, kind: str) -> list[dict]:
    return [r for r in read_metrics(out / METRICS_FILE) if r["type"] == kind]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out, "step")}


@pytest.mark.parametrize(("method", "epochs"), [("lora", 2), ("qlora", 1)])
def test_fsdp_equals_one_process_with_the_same_global_batch(
    make_config, tmp_path: Path, method: str, epochs: int
) -> None:
    # Evaluation on a second file every 2 steps: every rank evaluates (the forward all-gathers).
    kw = {"method": method, "epochs": epochs, "checkpoint_every_steps": 1}
    kw.update(validation_dataset_id="valdata01", eval_every_steps=2)
    val = {"validation_path": str(write_jsonl(tmp_path / "val.jsonl", qa_rows(3, start=50)))}
    fsdp = make_config(qa_rows(18), name="fsdp", **kw, **FSDP).model_copy(update=val)
    single = make_config(
        qa_rows(18), name="single", **kw, **{**FSDP, "num_gpus": 1, "gradient_accumulation_steps": 4}
    ).model_copy(update=val)
    out_fsdp, out_single = Path(fsdp.output_dir), Path(single.output_dir)

    proc = launch(fsdp, tmp_path)
    assert run(single) == EXIT_OK  # in this process, while the two ranks train
    rc, log = finish(proc)
    assert rc == 0, log
    assert "FSDP over 2 processes" in log

    steps = 3 * epochs
    assert sorted(losses(out_fsdp)) == list(range(1, steps + 1))  # rank 0 alone wrote the metrics
    assert losses(out_fsdp) == pytest.approx(losses(out_single), abs=1e-5)
    evals = {r["step"]: r["eval_loss"] for r in records(out_fsdp, "eval")}
    assert sorted(evals) == list(range(2, steps + 1, 2)) + ([steps] if steps % 2 else [])
    assert evals == pytest.approx({r["step"]: r["eval_loss"] for r in records(out_single, "eval")}, abs=1e-5)
    diff = max_diff(adapter(out_fsdp), adapter(out_single))
    print(f"{method}: max |FSDP - single process| over the adapter = {diff:.2e}")
    assert diff < 1e-4

    # FSDP checkpoints are sharded, a file per rank: one process reads both (DCP reshards on loading) and
    # resumes mid-epoch, to the same adapter.
    resumed = fsdp.model_copy(update={"output_dir": str(tmp_path / "resumed-n1")})
    ckpts = Path(resumed.output_dir) / CHECKPOINTS_DIR
    start = steps - 2
    shutil.copytree(out_fsdp / CHECKPOINTS_DIR / checkpoint_name(start), ckpts / checkpoint_name(start))
    assert run(resumed) == EXIT_OK
    assert [r["resumed_from_step"] for r in records(Path(resumed.output_dir), "start")] == [start]
    diff = max_diff(adapter(Path(resumed.output_dir)), adapter(out_fsdp))
    print(f"{method}: max |resumed on 1 process - FSDP| = {diff:.2e}")
    assert diff < 1e-5


def test_sigterm_to_one_rank_stops_both_at_the_same_step_and_resume_is_exact(
    make_config, tmp_path: Path
) -> None:
    kw = {"epochs": 4, "checkpoint_every_steps": 0, **FSDP}
    parted = make_config(qa_rows(18), name="parted", **kw)
    whole = make_config(qa_rows(18), name="whole", **kw)  # the same spec, run by one process
    out = Path(parted.output_dir)

    proc = launch(parted, tmp_path)
    while not records(out, "step"):
        assert proc.poll() is None, finish(proc)[1]
        time.sleep(0.02)
    # Only rank 1 gets the signal; rank 0, which writes the checkpoint, must learn of it and stop too.
    os.kill(rank_pid(proc.pid, 1), signal.SIGTERM)
    rc, log = finish(proc)
    assert rc != 0, log  # torchrun reports its ranks' exit code 3 as a failure...
    (stopped,) = records(out, "stopped")  # ...so the stop is recorded where the worker reads it
    k = stopped["step"]
    assert 1 <= k < 12, log
    assert max(losses(out)) == k
    assert list_checkpoints(out / CHECKPOINTS_DIR)[-1].name == checkpoint_name(k)
    assert not (out / ADAPTER_DIR).exists()

    assert run(whole) == EXIT_OK  # uninterrupted, one process
    rc, log = finish(launch(parted, tmp_path))  # resumed, two ranks again
    assert rc == 0, log
    assert [r["resumed_from_step"] for r in records(out, "start")] == [0, k]
    assert losses(out) == pytest.approx(losses(Path(whole.output_dir)), abs=1e-5)
    # Relative over each tensor (tests.training.util says why not elementwise): the gloo reduction's order
    # differs from one process's, so the last bits differ and Adam amplifies them in a few LoRA B values.
    got, uninterrupted = adapter(out), adapter(Path(whole.output_dir))
    diff = relative_difference(uninterrupted, got)
    print(
        f"stopped at step {k}, resumed under FSDP: relative difference to uninterrupted {diff:.1e} "
        f"(elementwise {elementwise(uninterrupted, got):.1e})"
    )
    assert diff < 1e-4


def rank_pid(launcher_pid: int, rank: int, timeout: float = 60) -> int:
    """The pid of torchrun's worker with RANK=rank (read from /proc: torchrun's children)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in _children(launcher_pid):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank} under {launcher_pid}")


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(c) for c in (task / "children").read_text().split()]
    return kids
