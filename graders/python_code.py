"""python: the user's grade(sample, item), sent to GradeContext.python (a sandbox) python_batch_size
samples per run() call; whatever it hands back that is not a finite number scores 0 with its error."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from graders.base import Batch, Grader, Pair
from graders.errors import GraderError
from graders.fields import JsonFields
from graders.python_grader import PythonOutcome, check_source
from graders.results import GradeErrors, GradeResult


@dataclass(frozen=True)
class PythonGrader(Grader):
    type: ClassVar[str] = "python"
    name: str
    source: str
    image_tag: str | None = None  # OpenAI's sandbox image; echoed, the runner decides what runs

    @classmethod
    def from_json(cls, fields: JsonFields, default_name: str, allow_python: bool) -> PythonGrader:
        fields.only(("type", "name", "source", "image_tag"))
        if not allow_python:
            raise GraderError(
                "python_grader_disabled", "python graders are disabled on this server", fields.at("type")
            )
        source = fields.string("source")
        check_source(source, fields.at("source"))
        image_tag = fields.string("image_tag") if fields.has("image_tag") else None
        return cls(name=fields.string("name", default_name), source=source, image_tag=image_tag)

    def to_json(self) -> dict[str, Any]:
        out = {"type": self.type, "name": self.name, "source": self.source}
        return {**out, "image_tag": self.image_tag} if self.image_tag is not None else out

    def grade_batch(self, pairs: Sequence[Pair], batch: Batch) -> list[GradeResult]:
        size = max(1, batch.ctx.python_batch_size)
        chunks = [list(pairs[start : start + size]) for start in range(0, len(pairs), size)]
        return [
            result for chunk in batch.map(lambda chunk: self._run(chunk, batch), chunks) for result in chunk
        ]

    def _run(self, calls: list[Pair], batch: Batch) -> list[GradeResult]:
        """One runner.run for `calls`; each result's execution_time is its share of the run's wall time."""
        start = time.perf_counter()
        runner = batch.ctx.python
        if runner is None:
            outcomes = [PythonOutcome(None, "python_grader_server_error", "no_sandbox")] * len(calls)
        else:
            try:
                outcomes = runner.run(self.source, calls)
            except Exception as exc:  # the sandbox itself failed: no call was graded
                outcomes = [PythonOutcome(None, "python_grader_server_error", type(exc).__name__)] * len(
                    calls
                )
            if len(outcomes) != len(calls):
                reason = f"the sandbox returned {len(outcomes)} outcomes for {len(calls)} calls"
                outcomes = [PythonOutcome(None, "python_grader_server_error", reason)] * len(calls)
        share = (time.perf_counter() - start) / max(1, len(calls))
        return [self._result(outcome, share) for outcome in outcomes]

    def _result(self, outcome: PythonOutcome, execution_time: float) -> GradeResult:
        reward, flag, details = outcome.reward, outcome.error, outcome.details
        if flag is None:
            if isinstance(reward, int | float) and not isinstance(reward, bool) and math.isfinite(reward):
                return self.result(float(reward), execution_time)
            flag, details = "python_grader_runtime_error", f"grade() returned {reward!r}, not a finite float"
        if flag not in ("python_grader_runtime_error", "python_grader_server_error"):
            flag = "other_error"
        return self.result(0.0, execution_time, errors=GradeErrors.of(flag, details))
