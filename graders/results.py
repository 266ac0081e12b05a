"""What grading one sample gives: a reward, OpenAI's error flags, and the run response built from them."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

TokenUsage = dict[str, int]  # prompt_tokens, completion_tokens, total_tokens

# The detail that travels with a flag (OpenAI's metadata.errors names).
_DETAIL_OF = {
    "model_grader_server_error": "model_grader_server_error_details",
    "python_grader_runtime_error": "python_grader_runtime_error_details",
    "python_grader_server_error": "python_grader_server_error_type",
}


@dataclass(frozen=True)
class GradeErrors:
    """OpenAI's GraderRunResponse metadata.errors: which ways grading a sample failed (all False: none).
    truncated_observation_error and unresponsive_reward_error are never set here: they are the sampler's
    to report (a sample cut off, a reward that never came), and kept so the shape is OpenAI's whole."""

    formula_parse_error: bool = False
    invalid_variable_error: bool = False
    model_grader_parse_error: bool = False
    model_grader_refusal_error: bool = False
    model_grader_server_error: bool = False
    model_grader_server_error_details: str | None = None
    other_error: bool = False
    python_grader_runtime_error: bool = False
    python_grader_runtime_error_details: str | None = None
    python_grader_server_error: bool = False
    python_grader_server_error_type: str | None = None
    sample_parse_error: bool = False
    truncated_observation_error: bool = False
    unresponsive_reward_error: bool = False

    @classmethod
    def of(cls, flag: str, details: str | None = None) -> GradeErrors:
        values: dict[str, Any] = {flag: True}
        if flag in _DETAIL_OF and details is not None:
            values[_DETAIL_OF[flag]] = details
        return cls(**values)

    @property
    def flags(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is True]

    def merged(self, other: GradeErrors) -> GradeErrors:
        """Either's flags; the first detail of each."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            values[f.name] = (
                (mine or theirs) if isinstance(mine, bool) else (theirs if mine is None else mine)
            )
        return GradeErrors(**values)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


NO_ERRORS = GradeErrors()


class GradeFailure(Exception):
    """Raised while grading one sample: it scores 0 with `flag` set (never escapes grade())."""

    def __init__(self, flag: str, details: str | None = None, usage: Mapping[str, TokenUsage] | None = None):
        super().__init__(details or flag)
        self.errors = GradeErrors.of(flag, details)
        self.usage = dict(usage or {})


@dataclass(frozen=True)
class GradeResult:
    """One sample's grade by one grader. `token_usage_per_model`: the judge models' token counts."""

    name: str
    type: str
    reward: float
    errors: GradeErrors = NO_ERRORS
    execution_time: float = 0.0
    sub_rewards: dict[str, float] = field(default_factory=dict)
    scores: dict[str, Any] = field(default_factory=dict)
    token_usage_per_model: dict[str, TokenUsage] = field(default_factory=dict)

    @property
    def token_usage(self) -> int | None:
        """Total tokens the judge models spent; None when no model grader ran."""
        if not self.token_usage_per_model:
            return None
        return sum(usage.get("total_tokens", 0) for usage in self.token_usage_per_model.values())

    def to_run_response(self) -> dict[str, Any]:
        """OpenAI's GraderRunResponse JSON (POST /v1/fine_tuning/alpha/graders/run)."""
        return {
            "reward": self.reward,
            "metadata": {
                "name": self.name,
                "type": self.type,
                "errors": self.errors.to_json(),
                "execution_time": self.execution_time,
                "scores": self.scores,
                "token_usage": self.token_usage,
                "sampled_model_name": None,
            },
            "sub_rewards": dict(self.sub_rewards),
            "model_grader_token_usage_per_model": {k: dict(v) for k, v in self.token_usage_per_model.items()},
        }


def add_usage(*usages: Mapping[str, TokenUsage]) -> dict[str, TokenUsage]:
    """Token usage per model, summed across graders."""
    total: dict[str, TokenUsage] = {}
    for usage in usages:
        for model, counts in usage.items():
            into = total.setdefault(model, {})
            for key, value in counts.items():
                into[key] = into.get(key, 0) + value
    return total


def count_errors(results: Iterable[GradeResult]) -> dict[str, int]:
    """How many results raised each flag: the counters a training step reports."""
    counts: Counter[str] = Counter()
    for result in results:
        counts.update(result.errors.flags)
    return dict(counts)
