"""Objective grpo end to end on the tiny model: rollouts, grading, GRPO's loss, records, resume."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from core.run_protocol import EXIT_OK, EXIT_STOPPED
from tests.training.util import read_metrics
from training.run import run

REPO = Path(__file__).resolve().parents[2]
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
        {
            "messages": [{"role": "user", "content": f"Say the letter a {i} times"}],
            "answer": "a" * (1 + i % 5),
        }
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
    evals = [r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "eval"]
    assert [e["step"] for e in evals] == [0, 3]  # the baseline before the first step, then eval_every_steps
    assert all(e["eval_loss"] is None and e["rl"]["samples"] == 2 for e in evals)
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
    assert [r["loss"] for r in steps(out)][-4:] == pytest.approx(
        [r["loss"] for r in steps(Path(whole.output_dir))], abs=1e-6
    )


@pytest.mark.slow
def test_grpo_killed_with_sigkill_resumes_to_the_rewards_of_an_uninterrupted_run(make_config) -> None:
    """kill -9 after the checkpoint at step 2: the rerun starts from it, samples what the uninterrupted
    run sampled at steps 3 and 4 (LoRA dropout on: its masks are the step's too), and grades them the same."""
    whole = grpo_config(make_config, name="whole9", max_steps=4, lora_dropout=0.1)
    assert run(whole) == EXIT_OK
    killed = grpo_config(make_config, name="killed", max_steps=4, checkpoint_every_steps=2, lora_dropout=0.1)
    out = Path(killed.output_dir)
    out.mkdir(parents=True)
    run_json = out.parent / "killed-run.json"
    run_json.write_text(killed.model_dump_json())
    child = subprocess.Popen([sys.executable, "-m", "training.run", str(run_json)], cwd=REPO)
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").is_file() or len(steps(out)) < 3:
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        child.kill()
        child.wait()
    assert (
        subprocess.run([sys.executable, "-m", "training.run", str(run_json)], cwd=REPO).returncode == EXIT_OK
    )
    starts = [r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "start"]
    assert starts[-1]["resumed_from_step"] == 2

    def by_step(o: Path) -> dict[int, float]:
        return {r["step"]: r["rl"]["reward_mean"] for r in steps(o)}

    assert by_step(out) == by_step(Path(whole.output_dir))


def test_a_rerun_with_the_same_seed_samples_and_grades_the_same(make_config) -> None:
    first, second = (grpo_config(make_config, name=n, max_steps=3) for n in ("first", "second"))
    assert run(first) == EXIT_OK and run(second) == EXIT_OK

    def trace(o: Path) -> list[tuple[float, float]]:
        return [(r["rl"]["reward_mean"], r["loss"]) for r in steps(o)]

    assert trace(Path(first.output_dir)) == trace(Path(second.output_dir))


def test_a_step_split_into_micro_batches_samples_and_trains_as_one_big_batch(make_config) -> None:
    """A step's prompts are sampled in one generate() call however the step is split, so micro 2 x
    accumulation 2 samples, grades and trains on what micro 4 x accumulation 1 does (the loss up to the
    order of its sums); rollout_batch_size 1 samples each prompt apart, other answers."""
    big, split, apart = (
        grpo_config(make_config, name=name, max_steps=3, **kw)
        for name, kw in [
            ("big", {"micro_batch_size": 4}),
            ("split", {"micro_batch_size": 2, "gradient_accumulation_steps": 2}),
            ("apart", {"micro_batch_size": 4, "rollout_batch_size": 1}),
        ]
    )
    for config in (big, split, apart):
        assert run(config) == EXIT_OK
    whole, parts, one_by_one = (steps(Path(c.output_dir)) for c in (big, split, apart))

    def answers(records: list[dict[str, Any]]) -> list[tuple[float, float]]:
        return [(r["rl"]["reward_mean"], r["rl"]["completion_tokens_mean"]) for r in records]

    assert answers(parts) == answers(whole)
    assert [r["loss"] for r in parts] == pytest.approx([r["loss"] for r in whole], abs=1e-6)
    assert [r["grad_norm"] for r in parts] == pytest.approx([r["grad_norm"] for r in whole], rel=1e-5)
    assert answers(one_by_one) != answers(whole)
