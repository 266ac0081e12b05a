"""The planner's prediction vs the peak a real training run measures, on CPU, within 15%.

Each config trains a few optimizer steps through `training.run` (the path a worker runs), whose CPU
tracker records the live tensor bytes of every step; the run's start record holds the planner's
allocated bytes for the same spec on a CPU device, planned from the run's largest micro-batch. Two tiny
Llama shapes: one where the vocab-sized loss buffers dominate, one where a decoder layer's activations
do. Every example is longer than max_seq_len, so every micro-batch is max_seq_len wide, as in the worst
case the planner assumes before a job's token statistics are known (bench/planner_self.py measures data
of varied lengths)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.arch import load_architecture
from core.run_protocol import RunConfig
from core.spec import JobSpec
from planner import BatchShape
from planner.feasibility import device_gpu, plan_on
from tests.training.util import read_metrics, write_jsonl
from training.demo import DemoSize, build_demo_model
from training.run import run

TOLERANCE = 0.15
SEQ = 128
# Wider layers and a small vocab: activations, not logits, make the peak.
WIDE = DemoSize(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=704,
                vocab_size=512, max_position_embeddings=512)  # fmt: skip

# shape, method, checkpointing, micro-batch, LoRA dropout, mixed precision ("bf16": CPU autocast, the
# GPU path's dtypes: bf16 activations, per-module LoRA casts, autocast copies of fp32 weights)
CONFIGS = [
    ("tiny", "lora", False, 2, 0.0, "no"),
    ("tiny", "qlora", True, 4, 0.05, "no"),
    ("tiny", "lora", False, 4, 0.0, "bf16"),
    ("wide", "lora", False, 2, 0.0, "no"),
    ("wide", "lora", False, 4, 0.05, "no"),
    ("wide", "lora", True, 2, 0.0, "no"),
    ("wide", "lora", True, 4, 0.0, "no"),
    ("wide", "qlora", False, 2, 0.0, "no"),
    ("wide", "qlora", True, 4, 0.0, "no"),
    ("wide", "lora", False, 2, 0.0, "bf16"),
    ("wide", "lora", True, 4, 0.05, "bf16"),
    ("wide", "qlora", True, 4, 0.0, "bf16"),
]


@pytest.fixture(scope="module")
def shapes(tiny_model: Path, models_dir: Path) -> dict[str, Path]:
    return {"tiny": tiny_model, "wide": build_demo_model(models_dir, name="wide", size=WIDE)}


# Objective dpo (a micro-batch of `batch` pairs is 2 x batch sequences; the reference forward runs first):
# shape, method, checkpointing, micro-batch (pairs), LoRA dropout, loss type
DPO_CONFIGS = [
    ("tiny", "lora", False, 2, 0.0, "sigmoid"),
    ("tiny", "qlora", True, 2, 0.05, "sigmoid"),
    ("wide", "lora", False, 2, 0.0, "sigmoid"),
    ("wide", "lora", True, 2, 0.0, "ipo"),
    ("wide", "qlora", True, 2, 0.0, "sigmoid"),
    ("wide", "lora", False, 1, 0.05, "simpo"),
]


@pytest.fixture(scope="module")
def long_pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Pairs whose replies are longer than max_seq_len: every side is max_seq_len tokens after truncation,
    nearly all of them scored (a short prompt), as the planner assumes (logits for every token)."""
    lines = (Path(__file__).parents[2] / "training" / "demo_corpus.txt").read_text().splitlines()
    rows: list[dict[str, Any]] = [
        {
            "prompt": " ".join(lines[i % len(lines)].split()[:2]),
            "chosen": " ".join(lines[(7 * i + j) % len(lines)] for j in range(40)),
            "rejected": " ".join(lines[(11 * i + j + 3) % len(lines)] for j in range(40)),
        }
        for i in range(12)
    ]
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", rows)


@pytest.fixture(scope="module")
def long_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lines = (Path(__file__).parents[2] / "training" / "demo_corpus.txt").read_text().splitlines()
    rows: list[dict[str, Any]] = [
        {"text": " ".join(lines[(7 * i + j) % len(lines)] for j in range(40))} for i in range(12)
    ]
    return write_jsonl(tmp_path_factory.mktemp("data") / "long.jsonl", rows)


def measured_run(
    spec_fields: dict[str, Any], model_dir: Path, data: Path, out: Path
) -> tuple[JobSpec, dict, int]:
    """Train two optimizer steps of `spec_fields` (micro x accumulation 2, LoRA r 8) through training.run:
    the spec, the run's start record (the planner's prediction) and the peak its tracker measured."""
    spec = JobSpec(
        dataset_id="testdata01",
        gradient_accumulation_steps=2,
        lora_r=8,
        lora_alpha=16,
        max_seq_len=SEQ,
        max_steps=2,
        checkpoint_every_steps=0,
        **spec_fields,
    )
    config = RunConfig(
        job_id="jobmem", spec=spec, model_dir=str(model_dir), dataset_path=str(data), output_dir=str(out)
    )
    assert run(config) == 0
    records = read_metrics(out / "metrics.jsonl")
    start = next(r for r in records if r["type"] == "start")
    return spec, start, [r for r in records if r["type"] == "step"][-1]["peak_mem_bytes"]


@pytest.mark.parametrize(("shape", "method", "ckpt", "batch", "dropout", "precision"), CONFIGS)
def test_prediction_within_15_percent_of_measured_peak(
    shapes: dict[str, Path],
    long_rows: Path,
    tmp_path: Path,
    shape: str,
    method: str,
    ckpt: bool,
    batch: int,
    dropout: float,
    precision: str,
) -> None:
    fields = {
        "base_model": shape,
        "method": method,
        "gradient_checkpointing": ckpt,
        "micro_batch_size": batch,
        "lora_dropout": dropout,
        "mixed_precision": precision,
    }
    spec, start, measured = measured_run(fields, shapes[shape], long_rows, tmp_path / "out")
    predicted = start["predicted_peak_bytes"]

    cpu = device_gpu({"kind": "cpu", "name": "cpu", "memory_bytes": 64 * 2**30})
    # the run plans from its data's largest micro-batch (every row max_seq_len wide here, a bit fewer scored)
    data = BatchShape.from_token_stats(start["token_stats"])
    assert data is not None and data.tokens == batch * SEQ
    assert predicted == plan_on(spec, load_architecture(shapes[shape]), cpu, shape=data).allocated_bytes
    error = (predicted - measured) / measured
    print(
        f"\n{shape:5} {method:5} ckpt={ckpt!s:5} batch={batch} dropout={dropout:.2f} amp={precision:4}: "
        f"predicted {predicted / 2**20:7.3f} MiB, measured {measured / 2**20:7.3f} MiB, "
        f"error {error:+.1%}"
    )
    assert abs(error) <= TOLERANCE


@pytest.mark.parametrize(("shape", "method", "ckpt", "batch", "dropout", "loss_type"), DPO_CONFIGS)
def test_dpo_prediction_within_15_percent_of_measured_peak(
    shapes: dict[str, Path],
    long_pairs: Path,
    tmp_path: Path,
    shape: str,
    method: str,
    ckpt: bool,
    batch: int,
    dropout: float,
    loss_type: str,
) -> None:
    fields = {
        "base_model": shape,
        "objective": "dpo",
        "loss_type": loss_type,
        "method": method,
        "gradient_checkpointing": ckpt,
        "micro_batch_size": batch,
        "lora_dropout": dropout,
        "mixed_precision": "no",
    }
    _, start, measured = measured_run(fields, shapes[shape], long_pairs, tmp_path / "out")
    predicted = start["predicted_peak_bytes"]
    error = (predicted - measured) / measured
    print(
        f"\ndpo {loss_type:7} {shape:5} {method:5} ckpt={ckpt!s:5} pairs={batch} dropout={dropout:.2f}: "
        f"predicted {predicted / 2**20:7.3f} MiB, measured {measured / 2**20:7.3f} MiB, error {error:+.1%}"
    )
    assert abs(error) <= TOLERANCE
