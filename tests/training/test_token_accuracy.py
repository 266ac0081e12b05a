"""The training token accuracy of a step (StepRecord.token_accuracy, /v1's train_mean_token_accuracy):
the share of the step's target tokens whose argmax prediction is the label, over all its micro-batches,
so every split of the same global batch reports the same accuracy; a dpo step has none."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.run_protocol import EXIT_OK
from core.storage import METRICS_FILE
from tests.training.util import pair_rows, qa_rows, read_metrics
from training.run import run

SPLITS = [
    {"micro_batch_size": 4, "gradient_accumulation_steps": 1},
    {"micro_batch_size": 1, "gradient_accumulation_steps": 4},
    {"micro_batch_size": 2, "gradient_accumulation_steps": 2},
]


def steps(config) -> list[dict]:
    return [r for r in read_metrics(Path(config.output_dir) / METRICS_FILE) if r["type"] == "step"]


def test_every_split_reports_the_same_token_accuracy(make_config) -> None:
    rows = qa_rows(10)  # the last step of the epoch is short
    runs = []
    for i, split in enumerate(SPLITS):
        config = make_config(rows, name=f"acc{i}", epochs=2, learning_rate=2e-2, **split)
        assert run(config) == EXIT_OK
        runs.append(steps(config))
    ref = [r["token_accuracy"] for r in runs[0]]
    assert all(a is not None and 0 <= a <= 1 for a in ref), ref
    assert ref[-1] > ref[0], ref  # it learns the answers
    for other in runs[1:]:
        # the same tokens counted over the same global batch (the splits' logits differ by float sums only)
        assert [r["token_accuracy"] for r in other] == pytest.approx(ref, abs=1e-9), (other, ref)
    assert [r["target_tokens"] for r in runs[0]] == [r["target_tokens"] for r in runs[1]]


def test_a_dpo_step_has_no_token_accuracy(make_config) -> None:
    config = make_config(pair_rows(8), name="dpo", max_steps=2, objective="dpo")
    assert run(config) == EXIT_OK
    assert [r["token_accuracy"] for r in steps(config)] == [None, None]
