"""Where python graders are admitted (graders.policy): where the operator enabled them, and only
where the sandbox isolates them, as its probe shows (graders.sandbox.why_unavailable)."""

from __future__ import annotations

from typing import Any

import pytest

from core.errors import InvalidInput
from graders import sandbox
from graders.policy import admitted
from graders.python_code import PythonGrader

PY = {"type": "python", "name": "exact", "source": "def grade(sample, item):\n    return 1.0\n"}
CHECK = {"type": "string_check", "input": "{{ sample.output_text }}", "reference": "a", "operation": "eq"}


def never() -> str | None:
    raise AssertionError("the sandbox was asked about a grader that holds no python grader")


def refusal(raw: Any, **policy: Any) -> InvalidInput:
    with pytest.raises(InvalidInput) as info:
        admitted(raw, judge=None, **policy)
    return info.value


def test_where_the_sandbox_cannot_isolate_python_graders_are_refused_naming_why() -> None:
    why = "namespaces unavailable or incomplete: [Errno 1] unshare: Operation not permitted"
    error = refusal(PY, python_enabled=True, sandbox=lambda: why)
    assert (error.code, error.param) == ("python_grader_unavailable", "grader.type")
    assert why in error.message and "python graders cannot run on this server" in error.message
    multi = {"type": "multi", "graders": {"a": CHECK, "exact": PY}, "calculate_output": "a + exact"}
    error = refusal(multi, python_enabled=True, sandbox=lambda: why)
    assert (error.code, error.param) == ("python_grader_unavailable", "grader.graders.exact.type")
    single = {"type": "multi", "graders": PY, "calculate_output": "exact"}  # the openai SDK's form
    assert refusal(single, python_enabled=True, sandbox=lambda: why).param == "grader.graders.type"


def test_the_operator_switch_comes_first_and_other_graders_never_ask_the_sandbox() -> None:
    assert refusal(PY, python_enabled=False, sandbox=never).code == "python_grader_disabled"
    multi = {"type": "multi", "graders": {"a": CHECK}, "calculate_output": "a"}
    for raw in (CHECK, multi):
        assert admitted(raw, python_enabled=True, judge=None, sandbox=never)


def test_this_machine_isolates_and_the_probe_runs_once() -> None:
    """The default verdict is the real probe's (Linux namespaces, here): asked twice, probed at most once."""
    assert sandbox.why_unavailable() is None
    probes = sandbox._isolation.cache_info().misses
    assert isinstance(admitted(PY, python_enabled=True, judge=None), PythonGrader)
    assert sandbox._isolation.cache_info().misses == probes
