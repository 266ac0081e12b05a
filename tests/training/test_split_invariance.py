"""Every split of a step's global batch trains the same adapter: micro 4 x accumulation 1, micro 1 x
accumulation 4, and 2 FSDP ranks (torchrun, gloo) x micro 2, packed and padded, with LoRA dropout on; and
so does a step of examples_per_step examples (/v1's batch_size), packed into as many rows as they fill,
whatever micro-batches those rows are cut into.

The global batch is fixed before it is split (training.batches), the loss is normalised by the step's
target tokens, and dropout masks are drawn per example (training.dropout), so the splits differ only
by the order floating-point sums run in. A run with a different effective batch (micro 2 x 1) is the
control: it must come out different, or the comparison could not fail.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.run_protocol import EXIT_OK
from core.storage import ADAPTER_DIR, METRICS_FILE
from tests.training.util import elementwise, qa_rows, read_metrics, relative_difference
from training.run import run
from worker.runner import training_command

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

SPLITS = {
    "micro 4 x accum 1": {"micro_batch_size": 4, "gradient_accumulation_steps": 1},
    "micro 1 x accum 4": {"micro_batch_size": 1, "gradient_accumulation_steps": 4},
    "2 ranks x micro 2": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "num_gpus": 2},
}
CONTROL = {"micro_batch_size": 2, "gradient_accumulation_steps": 1}  # a global batch of 2, not 4
SPEC = {"epochs": 2, "lora_dropout": 0.1, "lr_scheduler": "cosine", "warmup_steps": 1, "max_seq_len": 64}


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / ADAPTER_DIR / "adapter_model.safetensors")


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / METRICS_FILE) if r["type"] == "step"}


@pytest.mark.parametrize(
    ("packing", "per_step"),
    [(False, None), (True, None), (True, 6)],
    ids=["padded", "packed", "packed, 6 examples per step"],
)
def test_every_split_of_the_global_batch_trains_the_same_adapter(
    make_config, tmp_path: Path, packing: bool, per_step: int | None
) -> None:
    rows = qa_rows(22)  # 22 examples: the last step of an epoch is short (padded: 2 of 4 rows; 4 of 6)
    # examples_per_step: the step is that many examples (the control: half as many) whatever the split
    batch = {} if per_step is None else {"examples_per_step": per_step}
    control = CONTROL if per_step is None else {**CONTROL, "examples_per_step": per_step // 2}
    configs = {
        name: make_config(rows, name=f"split{i}", packing=packing, **SPEC, **{**batch, **split})
        for i, (name, split) in enumerate({**SPLITS, "control": control}.items())
    }
    start = time.monotonic()
    path = tmp_path / "fsdp.json"
    path.write_text(configs["2 ranks x micro 2"].model_dump_json())
    cmd = training_command(path)
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    for name in ("micro 4 x accum 1", "micro 1 x accum 4", "control"):  # while the two ranks train
        assert run(configs[name]) == EXIT_OK, name
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log
    assert "FSDP over 2 processes" in log

    outs = {name: Path(c.output_dir) for name, c in configs.items()}
    ref = outs["micro 4 x accum 1"]
    assert len(losses(ref)) >= 6
    for name in SPLITS:
        assert losses(outs[name]) == pytest.approx(losses(ref), rel=1e-5), name
    diffs = {name: relative_difference(adapter(ref), adapter(outs[name])) for name in SPLITS}
    worst = {name: elementwise(adapter(ref), adapter(outs[name])) for name in SPLITS}
    control = relative_difference(adapter(ref), adapter(outs["control"]))
    took = time.monotonic() - start
    kind = ("packed" if packing else "padded") + (f", {per_step} examples per step" if per_step else "")
    print(f"\n{kind}: relative difference to micro 4 x accum 1 (elementwise): "
          + ", ".join(f"{k} {v:.1e} ({worst[k]:.1e})" for k, v in diffs.items() if v)
          + f"; control (half the global batch) {control:.1e}; {took:.0f} s")  # fmt: skip
    assert diffs["micro 1 x accum 4"] < 1e-4
    assert diffs["2 ranks x micro 2"] < 1e-3
    assert control > 1e-2  # a different global batch trains a different adapter
