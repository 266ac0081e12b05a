"""Objective sft: next-token cross-entropy on the examples' targets (training.data reads them).

Its home: loss (a micro-batch's token losses over the step's target tokens, and a MoE router's
load-balancing term), step (one optimizer step on a global batch of examples; its metric: the token
accuracy) and evaluate (loss and token accuracy on a held-out split).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.spec import JobSpec
from training import data
from training.batches import Step
from training.objectives.base import BaseObjective, Evaluation
from training.objectives.sft import evaluate, step
from training.step import StepResult


class Sft(BaseObjective):
    @staticmethod
    def load(
        path: Path, tokenizer: Any, spec: JobSpec, column_mapping: dict[str, str] | None
    ) -> tuple[list[Any], int, dict[str, Any]]:
        return data.load_for_training(path, tokenizer, spec, column_mapping)

    def train_step(
        self, items: Sequence[Any], step_: Step, *, lr: float, dropout_key: Sequence[int], step_no: int
    ) -> StepResult:
        return step.train_step(self.ctx.parts, items, self.ctx.pad_id, step_, lr=lr, dropout_key=dropout_key)

    def evaluate(self, items: Sequence[Any], step_no: int) -> Evaluation:
        parts = self.ctx.parts
        ev = evaluate.evaluate(
            parts.model, items, parts.spec.micro_batch_size, self.ctx.pad_id, parts.device, parts.autocast
        )
        fields = {"eval_token_accuracy": ev.token_accuracy, "eval_tokens": ev.target_tokens}
        return Evaluation(ev.loss, fields, f"token accuracy {ev.token_accuracy:.3f}")

    @staticmethod
    def sample_prompts(items: Sequence[Any], n: int, tokenizer: Any) -> list[Any] | None:
        return None  # from the dataset file's examples (training.samples.example_prompts)
