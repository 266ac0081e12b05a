"""grpo's evaluation: the mean reward of one greedy answer to each of the first eval_samples validation
prompts (rl.reward_mean of the eval record; no loss to compare, so no best and no early stop)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from training.objectives.base import Context, Evaluation
from training.objectives.grpo.metrics import note, summarize
from training.objectives.grpo.rollout import Grading, sample
from training.rollouts import PromptItem


def evaluate(ctx: Context, grading: Grading, items: Sequence[PromptItem], step_no: int) -> Evaluation:
    spec = ctx.spec
    chosen = list(items[: spec.eval_samples or len(items)])
    start = time.perf_counter()
    # one answer each: as many prompts per generate() call as a step's rollouts have sequences
    groups = sample(ctx, chosen, 1, 0.0, (spec.seed, step_no), spec.rl.rollout_sequences)
    answers = [group[0] for group in groups]
    sampled = time.perf_counter()
    grades = grading.grade(list(zip(chosen, answers, strict=True)))
    timing = {"sampling": sampled - start, "grading": time.perf_counter() - sampled}
    metrics = summarize(grades, answers, {}, timing)
    return Evaluation(None, {"rl": metrics}, note(metrics))
