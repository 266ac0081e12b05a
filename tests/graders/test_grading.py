"""python graders through an injected runner, multi graders, grade_many, and the run response's shape."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from openai.types.fine_tuning.alpha import GraderRunResponse
from openai.types.fine_tuning.alpha.grader_run_response import Metadata, MetadataErrors

from graders import (
    GradeContext,
    GradeErrors,
    GradeResult,
    PythonOutcome,
    count_errors,
    grade,
    grade_many,
    make_sample,
    parse_grader,
)

Call = tuple[dict[str, Any], dict[str, Any]]


class InProcessRunner:
    """A test double of the sandbox: runs the (trusted, test-written) source here, one exec per run()."""

    def __init__(self) -> None:
        self.runs: list[int] = []  # the number of calls of each run()
        self.lock = threading.Lock()

    def run(self, source: str, calls: list[Call]) -> list[PythonOutcome]:
        with self.lock:
            self.runs.append(len(calls))
        namespace: dict[str, Any] = {}
        exec(source, namespace)
        outcomes = []
        for sample, item in calls:
            try:
                outcomes.append(PythonOutcome(namespace["grade"](sample, item), None, None))
            except Exception as exc:
                outcomes.append(
                    PythonOutcome(None, "python_grader_runtime_error", f"{type(exc).__name__}: {exc}")
                )
        return outcomes


class FixedRunner:
    def __init__(self, outcomes: list[PythonOutcome] | Exception) -> None:
        self.outcomes = outcomes

    def run(self, source: str, calls: list[Call]) -> list[PythonOutcome]:
        if isinstance(self.outcomes, Exception):
            raise self.outcomes
        return self.outcomes


LENGTH = {
    "type": "python",
    "name": "length",
    "source": "def grade(sample, item):\n    return len(sample['output_text']) / item['max']\n",
}
EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{ sample.output_json.city }}",
    "reference": "{{ item.city }}",
    "operation": "eq",
}
FUZZY = {
    "type": "text_similarity",
    "name": "fuzzy",
    "input": "{{ sample.output_json.city }}",
    "reference": "{{ item.city }}",
    "evaluation_metric": "fuzzy_match",
}


def flags(result: GradeResult) -> list[str]:
    return result.errors.flags


def valid(result: GradeResult) -> dict[str, Any]:
    response = result.to_run_response()
    GraderRunResponse.model_validate(response)
    return response


def test_python_grader() -> None:
    grader = parse_grader(LENGTH, allow_python=True)
    runner = InProcessRunner()
    result = grade(grader, make_sample("abcd"), {"max": 8}, GradeContext(python=runner))
    assert (result.reward, flags(result), runner.runs) == (0.5, [], [1])
    response = valid(result)
    assert response["metadata"]["name"] == "length" and response["metadata"]["type"] == "python"


def test_python_batches() -> None:
    grader = parse_grader(LENGTH, allow_python=True)
    runner = InProcessRunner()
    pairs = [(make_sample("x" * n), {"max": 10}) for n in range(10)]
    results = grade_many(grader, pairs, GradeContext(python=runner, python_batch_size=4), max_workers=3)
    assert [r.reward for r in results] == [n / 10 for n in range(10)]
    assert sorted(runner.runs) == [2, 4, 4]


@pytest.mark.parametrize(
    ("source", "item", "flag", "details"),
    [
        ("def grade(sample, item):\n    return item['max'] / 0\n", {"max": 1}, "python_grader_runtime_error",
         "ZeroDivisionError: division by zero"),
        ("def grade(sample, item):\n    return 'high'\n", {}, "python_grader_runtime_error",
         "grade() returned 'high', not a finite float"),
        ("def grade(sample, item):\n    return float('nan')\n", {}, "python_grader_runtime_error",
         "grade() returned nan, not a finite float"),
        ("def grade(sample, item):\n    return True\n", {}, "python_grader_runtime_error",
         "grade() returned True, not a finite float"),
    ],
)  # fmt: skip
def test_python_runtime_errors(source: str, item: dict[str, Any], flag: str, details: str) -> None:
    grader = parse_grader({**LENGTH, "source": source}, allow_python=True)
    result = grade(grader, make_sample("x"), item, GradeContext(python=InProcessRunner()))
    assert (result.reward, flags(result)) == (0.0, [flag])
    assert valid(result)["metadata"]["errors"]["python_grader_runtime_error_details"] == details


@pytest.mark.parametrize(
    ("runner", "kind"),
    [
        (FixedRunner([PythonOutcome(None, "python_grader_server_error", "timeout")]), "timeout"),
        (FixedRunner([PythonOutcome(None, "python_grader_server_error", "memory")]), "memory"),
        (FixedRunner(OSError("fork failed")), "OSError"),
        (FixedRunner([]), "the sandbox returned 0 outcomes for 1 calls"),
        (None, "no_sandbox"),
    ],
)
def test_python_server_errors(runner: FixedRunner | None, kind: str) -> None:
    grader = parse_grader(LENGTH, allow_python=True)
    result = grade(grader, make_sample("x"), {"max": 1}, GradeContext(python=runner))
    assert (result.reward, flags(result)) == (0.0, ["python_grader_server_error"])
    assert valid(result)["metadata"]["errors"]["python_grader_server_error_type"] == kind


def test_an_unknown_outcome_error_is_other_error() -> None:
    grader = parse_grader(LENGTH, allow_python=True)
    result = grade(
        grader, make_sample("x"), {}, GradeContext(python=FixedRunner([PythonOutcome(None, "odd", None)]))
    )
    assert flags(result) == ["other_error"]


def city_multi(graders: Any, formula: str) -> dict[str, Any]:
    return {"type": "multi", "name": "city", "graders": graders, "calculate_output": formula}


def test_multi_combines_named_graders() -> None:
    grader = parse_grader(
        city_multi(
            {"exact": EXACT, "fuzzy": FUZZY, "length": LENGTH}, "0.5 * exact + 0.3 * fuzzy + 0.2 * length"
        ),
        allow_python=True,
    )
    sample = make_sample('{"city": "Pariss"}')
    result = grade(grader, sample, {"city": "Paris", "max": 36}, GradeContext(python=InProcessRunner()))
    fuzzy = grade(parse_grader(FUZZY, allow_python=False), sample, {"city": "Paris"}, GradeContext()).reward
    assert result.sub_rewards == {"exact": 0.0, "fuzzy": fuzzy, "length": 0.5}
    assert result.reward == pytest.approx(0.3 * fuzzy + 0.1)
    assert flags(result) == []
    response = valid(result)
    assert (response["metadata"]["name"], response["metadata"]["type"]) == ("city", "multi")
    assert response["sub_rewards"] == result.sub_rewards


def test_multi_with_a_single_grader_object() -> None:
    grader = parse_grader(city_multi(EXACT, "exact * 2"), allow_python=False)
    result = grade(grader, make_sample('{"city": "Paris"}'), {"city": "Paris"}, GradeContext())
    assert (result.reward, result.sub_rewards) == (2.0, {"exact": 1.0})


def test_a_failed_sub_grader_counts_zero_and_raises_its_flag() -> None:
    grader = parse_grader(city_multi({"exact": EXACT, "length": LENGTH}, "exact + length"), allow_python=True)
    result = grade(
        grader, make_sample("not json"), {"city": "Paris", "max": 8}, GradeContext(python=InProcessRunner())
    )
    assert result.sub_rewards == {"exact": 0.0, "length": 1.0}
    assert (result.reward, flags(result)) == (1.0, ["sample_parse_error"])


def test_a_formula_without_a_value_is_formula_parse_error() -> None:
    grader = parse_grader(city_multi({"exact": EXACT}, "1 / exact"), allow_python=False)
    result = grade(grader, make_sample('{"city": "Lyon"}'), {"city": "Paris"}, GradeContext())
    assert (result.reward, flags(result), result.sub_rewards) == (
        0.0,
        ["formula_parse_error"],
        {"exact": 0.0},
    )
    valid(result)


def test_multi_batches_its_python_sub_graders() -> None:
    grader = parse_grader(city_multi({"exact": EXACT, "length": LENGTH}, "exact + length"), allow_python=True)
    runner = InProcessRunner()
    pairs = [(make_sample('{"city": "Paris"}'), {"city": "Paris", "max": 17})] * 5
    results = grade_many(grader, pairs, GradeContext(python=runner, python_batch_size=64))
    assert runner.runs == [5]
    assert [r.reward for r in results] == [2.0] * 5


def test_grade_never_raises_for_a_sample() -> None:
    grader = parse_grader(EXACT, allow_python=False)
    result = grade(
        grader, {"output_text": "x"}, {"city": "Paris"}, GradeContext()
    )  # no output_json key at all
    assert flags(result) == ["sample_parse_error"]
    broken = grade(grader, {"output_json": {"city": object()}}, {"city": "Paris"}, GradeContext())
    assert (broken.reward, flags(broken)) == (0.0, ["other_error"])  # not JSON-renderable: a surprise, caught


def test_grade_many_keeps_order_and_counts_errors() -> None:
    grader = parse_grader(EXACT, allow_python=False)
    texts = ['{"city": "Paris"}', "oops", '{"city": "Rome"}', '{"town": "Paris"}']
    results = grade_many(
        grader, [(make_sample(t), {"city": "Paris"}) for t in texts], GradeContext(), max_workers=2
    )
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 0.0]
    assert count_errors(results) == {"sample_parse_error": 1, "invalid_variable_error": 1}
    assert grade_many(grader, [], GradeContext()) == []


def test_run_response_shape() -> None:
    errors = GradeErrors.of("model_grader_server_error", "HTTP 500").merged(
        GradeErrors.of("python_grader_server_error", "timeout")
    )
    result = GradeResult(
        name="g",
        type="multi",
        reward=0.0,
        errors=errors,
        execution_time=0.5,
        sub_rewards={"a": 0.0},
        token_usage_per_model={"m": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}},
    )
    response = result.to_run_response()
    parsed = GraderRunResponse.model_validate(response)
    assert parsed.metadata.errors.api_model_grader_server_error_details == "HTTP 500"
    assert parsed.metadata.errors.python_grader_server_error_type == "timeout"
    assert parsed.metadata.token_usage == 3
    assert set(response) == {"reward", "metadata", "sub_rewards", "model_grader_token_usage_per_model"}
    assert set(response["metadata"]) == set(Metadata.model_fields)
    aliases = {field.alias or name for name, field in MetadataErrors.model_fields.items()}
    assert set(response["metadata"]["errors"]) == aliases
    assert errors.flags == ["model_grader_server_error", "python_grader_server_error"]
