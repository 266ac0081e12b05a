"""multi: named graders combined by calculate_output into one reward (RFT only, as OpenAI).

Each sub-grader grades the whole batch in turn (so python sub-graders still go to the sandbox a batch at
a time), then the formula combines each sample's sub-rewards. A sub-grader that failed counts 0 in the
formula and its error flags become the multi's; the reward is still the formula's, so one failed
sub-grader does not zero the others' credit. A formula with no finite value for a sample (x/0, log(0)...)
scores 0 with formula_parse_error. sub_rewards: each named grader's reward."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from graders.base import Batch, Grader, Pair
from graders.formula import Formula, FormulaError
from graders.results import GradeErrors, GradeResult, add_usage


@dataclass(frozen=True)
class MultiGrader(Grader):
    type: ClassVar[str] = "multi"
    name: str
    graders: dict[str, Grader]
    calculate_output: Formula

    def to_json(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "name": self.name,
            "graders": {key: grader.to_json() for key, grader in self.graders.items()},
            "calculate_output": self.calculate_output.source,
        }

    def grade_batch(self, pairs: Sequence[Pair], batch: Batch) -> list[GradeResult]:
        by_grader = {key: grader.grade_batch(pairs, batch) for key, grader in self.graders.items()}
        return [
            self._combine({key: results[row] for key, results in by_grader.items()})
            for row in range(len(pairs))
        ]

    def _combine(self, parts: dict[str, GradeResult]) -> GradeResult:
        errors = GradeErrors()
        for part in parts.values():
            errors = errors.merged(part.errors)
        sub_rewards = {key: part.reward for key, part in parts.items()}
        try:
            reward = self.calculate_output.evaluate(sub_rewards)
        except FormulaError:
            reward, errors = 0.0, errors.merged(GradeErrors.of("formula_parse_error"))
        return self.result(
            reward,
            sum(part.execution_time for part in parts.values()),
            errors=errors,
            usage=add_usage(*(part.token_usage_per_model for part in parts.values())),
            sub_rewards=sub_rewards,
        )
