"""The objective protocol and what its implementations share (training.objectives says what it is)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from core.run_protocol import RunConfig
from core.spec import JobSpec
from training.batches import Step
from training.step import Parts, StepResult


@dataclass(frozen=True)
class Context:
    """What an objective's steps use besides the items: built once by the recipe's setup."""

    config: RunConfig
    parts: Parts
    pad_id: int
    tokenizer: Any

    @property
    def spec(self) -> JobSpec:
        return self.parts.spec


@dataclass(frozen=True)
class Evaluation:
    """An evaluation's result: `loss` (None where the objective has no loss to compare: grpo), the
    eval record's other fields, and the log line's text."""

    loss: float | None
    fields: dict[str, Any] = field(default_factory=dict)
    note: str = ""


class Objective(Protocol):
    # Evaluate once before the first step too (grpo: the start of the validation reward curve).
    evaluates_at_start: bool

    def __init__(self, ctx: Context) -> None: ...

    @staticmethod
    def load(
        path: Path, tokenizer: Any, spec: JobSpec, column_mapping: dict[str, str] | None
    ) -> tuple[list[Any], int, dict[str, Any]]:
        """(the items training keeps, how many were dropped, the file's token statistics)."""
        ...

    def train_step(
        self, items: Sequence[Any], step: Step, *, lr: float, dropout_key: Sequence[int], step_no: int
    ) -> StepResult:
        """One optimizer step on the global batch `step` (rows of indices into `items`); `step_no`: the
        steps done before it (seeds what the step samples)."""
        ...

    def evaluate(self, items: Sequence[Any], step_no: int) -> Evaluation: ...

    @staticmethod
    def sample_prompts(items: Sequence[Any], n: int, tokenizer: Any) -> list[Any] | None:
        """The first n items' prompts for before/after samples (training.samples.Prompt); None: the
        prompts come from the dataset file's examples (sft)."""
        ...


class BaseObjective:
    """What every objective's class starts from: its context, and no evaluation before the first step."""

    evaluates_at_start = False

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
