"""Continuing from a checkpoint (spec.init_from_step): training.model reads a checkpoint directory as it
reads a final adapter (the same shape, the same weights under peft's names), and a run started from it
starts from the weights saved at that step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.run_protocol import EXIT_OK
from core.storage import ADAPTER_DIR, CHECKPOINTS_DIR, METRICS_FILE
from tests.training.util import qa_rows, read_metrics
from training.checkpoint import checkpoint_name
from training.model import read_trained_adapter
from training.run import run

# One global batch (2 x 2) of 4 examples: every step of a run on it trains on the same examples.
ONE_BATCH = {
    "max_steps": 3,
    "checkpoint_every_steps": 1,
    "micro_batch_size": 2,
    "gradient_accumulation_steps": 2,
}


def test_a_checkpoint_reads_as_the_adapter_saved_at_its_step(make_config) -> None:
    first = make_config(qa_rows(4), name="first", **ONE_BATCH)
    assert run(first) == EXIT_OK
    out = Path(first.output_dir)
    ckpt_config, ckpt = read_trained_adapter(out / CHECKPOINTS_DIR / checkpoint_name(3))
    final_config, final = read_trained_adapter(out / ADAPTER_DIR)
    shape = (
        "r",
        "lora_alpha",
        "bias",
    )  # the modules: the weights' names below (peft saves all-linear resolved)
    assert [getattr(ckpt_config, f) for f in shape] == [getattr(final_config, f) for f in shape]
    assert ckpt.keys() == final.keys() and ckpt
    for k in final:
        assert torch.equal(ckpt[k], final[k]), k

    # A run from the step-2 checkpoint: its first forward pass (before any update) uses the weights the
    # first run's step 3 used, on the same examples, so it logs the same loss.
    again = make_config(qa_rows(4), name="again", init_from="jobfirst", init_from_step=2, **ONE_BATCH)
    again = again.model_copy(update={"init_adapter_dir": str(out / CHECKPOINTS_DIR / checkpoint_name(2))})
    assert run(again) == EXIT_OK
    losses, restarted = (
        [r["loss"] for r in read_metrics(Path(c.output_dir) / METRICS_FILE) if r["type"] == "step"]
        for c in (first, again)
    )
    assert len(set(losses)) == 3  # each step's weights differ
    assert restarted[0] == pytest.approx(losses[2], rel=1e-5), (restarted, losses)
