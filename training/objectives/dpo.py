"""Objective dpo: preference pairs against a reference policy (training.preference, training.dpo)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.spec import JobSpec
from training import dpo, preference, samples
from training.batches import Step
from training.objectives.base import BaseObjective, Evaluation
from training.step import StepResult


class Dpo(BaseObjective):
    @staticmethod
    def load(
        path: Path, tokenizer: Any, spec: JobSpec, column_mapping: dict[str, str] | None
    ) -> tuple[list[Any], int, dict[str, Any]]:
        return preference.load_for_training(path, tokenizer, spec, column_mapping)

    def train_step(
        self, items: Sequence[Any], step: Step, *, lr: float, dropout_key: Sequence[int], step_no: int
    ) -> StepResult:
        return dpo.train_step(self.ctx.parts, items, self.ctx.pad_id, step, lr=lr, dropout_key=dropout_key)

    def evaluate(self, items: Sequence[Any], step_no: int) -> Evaluation:
        on = dpo.evaluate(self.ctx.parts, items, self.ctx.pad_id, self.ctx.spec.micro_batch_size)
        return Evaluation(on.loss, dict(on.metrics), f"reward accuracy {on.metrics['rewards_accuracy']:.3f}")

    @staticmethod
    def sample_prompts(items: Sequence[Any], n: int, tokenizer: Any) -> list[Any] | None:
        return samples.pair_prompts(items, tokenizer, n)
