"""Objective grpo: reinforcement fine-tuning with GRPO, as TRL 1.16's GRPOTrainer computes it.

One optimizer step on a global batch of prompts (training.rollouts.PromptItem; step):
1. sampling: each prompt answered num_generations times by the policy being trained (rollout.sample,
   seeded by (seed, step): a resumed run samples what an uninterrupted one would), rollout_prompts
   prompts per generate() call (all of the step's by default: the samples, like the step, do not
   depend on its split into micro-batches);
2. grading: every answer scored by the spec's grader (rollout.Grading; OpenAI's grader JSON) against
   its dataset row, in a bounded thread pool; a failed grade scores 0 and counts its error;
3. training: group-relative advantages and GRPO's clipped loss (loss) over micro-batches of whole
   groups (micro_batch_size prompts x num_generations completions each), each micro-batch its share of
   the step's loss over the step's totals, so accumulation equals one big batch. With beta > 0 the
   reference's log-probs come from the same model with the adapter off (training.reference: no second
   model), under no_grad before the policy's forward, as dpo's do. One update per rollout batch: the
   sampling policy is the one being trained (TRL's num_iterations 1), so the old log-probs are the
   current ones, detached.
The three phases are timed apart (the step record's rl.timing; metrics). Evaluation grades one greedy
answer to each of the first eval_samples validation prompts (evaluate: rl.reward_mean of the eval record).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.spec import JobSpec
from training import rollouts
from training.batches import Step
from training.objectives.base import BaseObjective, Context, Evaluation
from training.objectives.grpo import evaluate, step
from training.objectives.grpo.rollout import Grading
from training.samples import Prompt
from training.step import StepResult


class Grpo(BaseObjective):
    evaluates_at_start = True  # the reward before training: the start of the curve

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.grading = Grading.of(ctx)

    @staticmethod
    def load(
        path: Path, tokenizer: Any, spec: JobSpec, column_mapping: dict[str, str] | None
    ) -> tuple[list[Any], int, dict[str, Any]]:
        return rollouts.load_for_training(path, tokenizer, spec, column_mapping)

    def train_step(
        self, items: Sequence[Any], step_: Step, *, lr: float, dropout_key: Sequence[int], step_no: int
    ) -> StepResult:
        return step.train_step(
            self.ctx, self.grading, items, step_, lr=lr, dropout_key=dropout_key, step_no=step_no
        )

    def evaluate(self, items: Sequence[Any], step_no: int) -> Evaluation:
        return evaluate.evaluate(self.ctx, self.grading, items, step_no)

    @staticmethod
    def sample_prompts(items: Sequence[Any], n: int, tokenizer: Any) -> list[Any] | None:
        return [
            Prompt(tokenizer.decode(p.input_ids, skip_special_tokens=True), p.input_ids) for p in items[:n]
        ]
