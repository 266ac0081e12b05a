"""Objective dpo: preference tuning, each pair's chosen reply against its rejected one.

Its home: pairs (a preference file -> token ids, labels on the replies; the truncation policy), loss
(sigmoid, ipo, simpo and rpo_alpha, against the reference policy of training.reference), step (one
optimizer step on a global batch of pairs, each micro-batch holding whole pairs), metrics (rewards,
reward accuracy and margin, log-probs: its step and eval records' fields) and evaluate (held-out pairs).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.spec import JobSpec
from training import samples
from training.batches import Step
from training.objectives.base import BaseObjective, Evaluation
from training.objectives.dpo import evaluate, metrics, pairs, step
from training.step import StepResult


class Dpo(BaseObjective):
    @staticmethod
    def load(
        path: Path, tokenizer: Any, spec: JobSpec, column_mapping: dict[str, str] | None
    ) -> tuple[list[Any], int, dict[str, Any]]:
        return pairs.load_for_training(path, tokenizer, spec, column_mapping)

    def train_step(
        self, items: Sequence[Any], step_: Step, *, lr: float, dropout_key: Sequence[int], step_no: int
    ) -> StepResult:
        return step.train_step(self.ctx.parts, items, self.ctx.pad_id, step_, lr=lr, dropout_key=dropout_key)

    def evaluate(self, items: Sequence[Any], step_no: int) -> Evaluation:
        on = evaluate.evaluate(self.ctx.parts, items, self.ctx.pad_id, self.ctx.spec.micro_batch_size)
        return Evaluation(on.loss, dict(on.metrics), metrics.note(on.metrics))

    @staticmethod
    def sample_prompts(items: Sequence[Any], n: int, tokenizer: Any) -> list[Any] | None:
        return samples.pair_prompts(items, tokenizer, n)
