"""Objective grpo end to end on the tiny model: rollouts, grading, GRPO's loss, records, resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.run_protocol import EXIT_OK, EXIT_STOPPED
from tests.training.util import read_metrics
from training.run import run

# Rewards an answer for each "a" it has (capped): something a random tiny model's samples differ in.
GRADER = {
    "type": "text_similarity",
    "name": "close",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "evaluation_metric": "fuzzy_match",
}


def prompt_rows(n: int) -> list[dict[str, Any]]:
    return [
        {"messages": [{"role": "user", "content": f"Say the letter a {i} times"}], "answer": "a" * (1 + i % 5)}
        for i in range(n)
    ]


def grpo_config(make_config, **kw: Any):
    spec = {
        "objective": "grpo",
        "grader": GRADER,
        "num_generations": 4,
        "max_completion_tokens": 8,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_seq_len": 64,
        "max_steps": 3,
        **kw,
    }
    return make_config(prompt_rows(8), **spec)


def steps(out: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "step"]


def test_a_grpo_run_records_rewards_timing_and_writes_an_adapter(make_config) -> None:
    config = grpo_config(make_config, beta=0.04, validation_fraction=0.25, eval_every_steps=3)
    assert run(config) == EXIT_OK
    out = Path(config.output_dir)
    recorded = steps(out)
    assert [r["step"] for r in recorded] == [1, 2, 3]
    for r in recorded:
        rl = r["rl"]
        assert rl["samples"] == 2 * 4  # two prompts a step, four answers each
        assert 0.0 <= rl["reward_mean"] <= 1.0
        assert set(rl["timing"]) == {"sampling", "grading", "training"}
        assert rl["kl"] is not None and rl["kl"] >= 0  # beta > 0: the KL to the reference
        assert 1 <= rl["completion_tokens_mean"] <= 8
    (ev,) = [r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "eval"]
    assert ev["eval_loss"] is None and ev["rl"]["samples"] == 2
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_grpo_resume_gives_the_same_rewards_as_an_uninterrupted_run(make_config) -> None:
    whole = grpo_config(make_config, name="whole", max_steps=4)
    assert run(whole) == EXIT_OK

    class StopAfter:
        """Asks to stop once two steps are recorded."""

        def __init__(self, out: Path) -> None:
            self.out = out

        def is_set(self) -> bool:
            path = self.out / "metrics.jsonl"
            return path.is_file() and len(steps(self.out)) >= 2

    parted = grpo_config(make_config, name="parted", max_steps=4)
    out = Path(parted.output_dir)
    assert run(parted, StopAfter(out)) == EXIT_STOPPED
    assert run(parted) == EXIT_OK

    def rewards(o: Path) -> list[float]:
        return [r["rl"]["reward_mean"] for r in read_metrics(o / "metrics.jsonl") if r["type"] == "step"]

    assert rewards(out)[-4:] == rewards(Path(whole.output_dir))
    assert [r["loss"] for r in steps(out)][-4:] == pytest.approx([r["loss"] for r in steps(Path(whole.output_dir))], abs=1e-6)
