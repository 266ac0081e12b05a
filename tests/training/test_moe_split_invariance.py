"""Split invariance on mixture-of-experts bases (tests/training/test_split_invariance.py's, for the dense
ones): micro 4 x accumulation 1, micro 1 x accumulation 4 and 2 FSDP ranks (torchrun, gloo) x micro 2
train the same adapter, each tensor within 1e-4 (relative Frobenius).

Tiny random-weight bases of transformers' own classes (training.demo_moe): a Qwen3-MoE whose config asks
for the router's load-balancing loss (taken per example, weighted by its tokens: training.moe, so it is
a sum over examples as the cross-entropy is), LoRA on the attention with dropout 0.1, packed and padded;
and a Mixtral with LoRA on the attention and on both expert stacks (peft's target_parameters, no
dropout), packed. A run with half the global batch is the control: it must differ.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

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
SPEC = {"epochs": 2, "lr_scheduler": "cosine", "warmup_steps": 1, "max_seq_len": 64, "learning_rate": 1e-2}
EXPERTS = ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe, aux loss, packed": ("qwen3_moe", {"packing": True, "lora_dropout": 0.1}),
    "qwen3_moe, aux loss, padded": ("qwen3_moe", {"packing": False, "lora_dropout": 0.1}),
    "mixtral, expert LoRA, packed": (
        "mixtral",
        {"packing": True, "lora_dropout": 0.0, "lora_target_modules": EXPERTS},
    ),
}


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / ADAPTER_DIR / "adapter_model.safetensors")


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / METRICS_FILE) if r["type"] == "step"}


@pytest.mark.parametrize("case", list(CASES))
def test_every_split_trains_the_same_adapter_on_a_moe_base(
    make_config, moe_models: dict[str, Path], tmp_path: Path, case: str
) -> None:
    family, fields = CASES[case]
    rows = qa_rows(22)  # the last step of an epoch is short
    configs = {
        name: make_config(rows, model_dir=moe_models[family], name=f"moe{i}", **SPEC, **fields, **split)
        for i, (name, split) in enumerate({**SPLITS, "control": CONTROL}.items())
    }
    start = time.monotonic()
    path = tmp_path / "fsdp.json"
    path.write_text(configs["2 ranks x micro 2"].model_dump_json())
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    proc = subprocess.Popen(
        training_command(path), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    for name in ("micro 4 x accum 1", "micro 1 x accum 4", "control"):  # while the two ranks train
        assert run(configs[name]) == EXIT_OK, name
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log
    assert "FSDP over 2 processes" in log

    outs = {name: Path(c.output_dir) for name, c in configs.items()}
    ref = outs["micro 4 x accum 1"]
    assert len(losses(ref)) >= 6
    if fields.get("lora_target_modules") == EXPERTS:
        assert any(".mlp.experts." in k for k in adapter(ref))  # the expert stacks were trained
    for name in SPLITS:
        assert losses(outs[name]) == pytest.approx(losses(ref), rel=1e-5), name
    diffs = {name: relative_difference(adapter(ref), adapter(outs[name])) for name in SPLITS}
    worst = {name: elementwise(adapter(ref), adapter(outs[name])) for name in SPLITS}
    control = relative_difference(adapter(ref), adapter(outs["control"]))
    print(f"\n{case}: relative difference to micro 4 x accum 1 (elementwise): "
          + ", ".join(f"{k} {v:.1e} ({worst[k]:.1e})" for k, v in diffs.items() if v)
          + f"; control (global batch 2) {control:.1e}; {time.monotonic() - start:.0f} s")  # fmt: skip
    assert diffs["micro 1 x accum 4"] <= 1e-4
    assert diffs["2 ranks x micro 2"] <= 1e-4
    assert control > 1e-2  # a different global batch trains a different adapter
