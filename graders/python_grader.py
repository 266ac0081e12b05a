"""The python grader's contract with its sandbox: the user's `def grade(sample, item) -> float` is never
run in this process but by a PythonRunner (graders.sandbox); this module says what a runner is
handed and hands back, and checks a source when the grader is parsed (at most 256 kB, valid Python, a
top-level `grade`). The grader that calls a runner is python_code.PythonGrader."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Protocol

from graders.errors import GraderError

MAX_SOURCE_BYTES = 256 * 1024  # OpenAI: "less than 256kB"


@dataclass(frozen=True)
class PythonOutcome:
    """One call's outcome. `error`: "python_grader_runtime_error" (grade() raised or returned no number;
    `details` the exception text) or "python_grader_server_error" (the sandbox killed it: timeout, memory;
    `details` a short reason, reported as python_grader_server_error_type); None when `reward` is set."""

    reward: float | None
    error: str | None
    details: str | None


class PythonRunner(Protocol):
    def run(self, source: str, calls: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[PythonOutcome]:
        """grade(sample, item) for each call, in order, one outcome each."""
        ...


def check_source(source: str, param: str) -> None:
    """Refuse what can never grade, before any sample is sampled. Parsing is not running: ast.parse only."""
    if len(source.encode("utf-8")) > MAX_SOURCE_BYTES:
        raise GraderError("python_source_too_large", f"{param} is over {MAX_SOURCE_BYTES} bytes", param)
    try:
        module = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise GraderError("invalid_python_source", f"{param} does not parse: {exc}", param) from None
    if not any(_binds_grade(statement) for statement in module.body):
        raise GraderError("invalid_python_source", f"{param} defines no top-level grade(sample, item)", param)


def _binds_grade(statement: ast.stmt) -> bool:
    if isinstance(statement, ast.FunctionDef):
        return statement.name == "grade"
    if isinstance(statement, ast.Assign):
        return any(isinstance(target, ast.Name) and target.id == "grade" for target in statement.targets)
    if isinstance(statement, ast.ImportFrom):
        return any((alias.asname or alias.name) == "grade" for alias in statement.names)
    return False
