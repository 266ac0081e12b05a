"""parse_grader: each refusal's code and the field it names; the normalised JSON it echoes."""

from __future__ import annotations

from typing import Any

import pytest

from graders import GRADER_ERROR_CODES, MAX_SOURCE_BYTES, GraderError, parse_grader

STRING_CHECK = {
    "type": "string_check",
    "name": "s",
    "input": "{{sample.output_text}}",
    "reference": "x",
    "operation": "eq",
}
SIMILARITY = {
    "type": "text_similarity",
    "name": "t",
    "input": "{{sample.output_text}}",
    "reference": "{{item.ref}}",
    "evaluation_metric": "fuzzy_match",
}
PYTHON = {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1.0\n"}
SCORE = {
    "type": "score_model",
    "name": "judge",
    "model": "m",
    "input": [{"role": "user", "content": "{{item.q}}"}],
}
LABEL = {
    "type": "label_model",
    "name": "l",
    "model": "m",
    "input": [{"role": "user", "content": "{{sample.output_text}}"}],
    "labels": ["good", "bad"],
    "passing_labels": ["good"],
}


def multi(graders: Any, formula: str = "a") -> dict[str, Any]:
    return {"type": "multi", "name": "m", "graders": graders, "calculate_output": formula}


def with_(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = {**base, **changes}
    return {k: v for k, v in out.items() if v is not None}


CASES: list[tuple[Any, str, str]] = [
    ("not an object", "invalid_grader", "grader"),
    ({}, "unknown_grader_type", "grader.type"),
    ({"type": "regex"}, "unknown_grader_type", "grader.type"),
    (with_(STRING_CHECK, input=None), "invalid_grader", "grader.input"),
    (with_(STRING_CHECK, input=3), "invalid_grader", "grader.input"),
    (with_(STRING_CHECK, refrence="x"), "invalid_grader", "grader.refrence"),
    (with_(STRING_CHECK, operation="contains"), "invalid_operation", "grader.operation"),
    (with_(STRING_CHECK, reference="{{ items.x }}"), "invalid_template", "grader.reference"),
    (with_(STRING_CHECK, input="{{" * 40_000), "template_too_long", "grader.input"),
    (multi({f"g{i}": STRING_CHECK for i in range(400)}, "g0"), "grader_too_large", "grader"),
    (with_(SIMILARITY, evaluation_metric="rouge_6"), "invalid_evaluation_metric", "grader.evaluation_metric"),
    (
        with_(SIMILARITY, evaluation_metric="cosine"),
        "unsupported_evaluation_metric",
        "grader.evaluation_metric",
    ),
    (with_(SIMILARITY, pass_threshold="high"), "invalid_grader", "grader.pass_threshold"),
    (with_(PYTHON, source=None), "invalid_grader", "grader.source"),
    (with_(PYTHON, source="def grade(:"), "invalid_python_source", "grader.source"),
    (with_(PYTHON, source="x = 1\n"), "invalid_python_source", "grader.source"),
    (with_(PYTHON, source="\0"), "invalid_python_source", "grader.source"),
    (
        with_(PYTHON, source="def grade(s, i):\n    return 1\n#" + "x" * MAX_SOURCE_BYTES),
        "python_source_too_large",
        "grader.source",
    ),
    (with_(SCORE, model=None), "invalid_grader", "grader.model"),
    (with_(SCORE, input=[]), "invalid_grader", "grader.input"),
    (with_(SCORE, input=[{"role": "robot", "content": "x"}]), "invalid_grader", "grader.input.0.role"),
    (
        with_(SCORE, input=[{"role": "user", "content": "x", "type": "chat"}]),
        "invalid_grader",
        "grader.input.0.type",
    ),
    (
        with_(SCORE, input=[{"role": "user", "content": [{"type": "input_text", "text": "{{ x.y }}"}]}]),
        "invalid_template",
        "grader.input.0.content.0.text",
    ),
    (
        with_(
            SCORE,
            input=[{"role": "user", "content": {"type": "input_image", "image_url": "u", "detail": "max"}}],
        ),
        "invalid_grader",
        "grader.input.0.content.detail",
    ),
    (
        with_(SCORE, input=[{"role": "user", "content": [{"type": "input_video"}]}]),
        "invalid_grader",
        "grader.input.0.content.0.type",
    ),
    (with_(SCORE, range=[1]), "invalid_grader", "grader.range"),
    (with_(SCORE, range=[0, "1"]), "invalid_grader", "grader.range.1"),
    (with_(SCORE, range=[1, 1]), "invalid_grader", "grader.range"),
    (
        with_(SCORE, sampling_params={"temperature": "hot"}),
        "invalid_grader",
        "grader.sampling_params.temperature",
    ),
    (
        with_(SCORE, sampling_params={"max_completions_tokens": 0}),
        "invalid_grader",
        "grader.sampling_params.max_completions_tokens",
    ),
    (
        with_(SCORE, sampling_params={"reasoning_effort": "huge"}),
        "invalid_grader",
        "grader.sampling_params.reasoning_effort",
    ),
    (with_(SCORE, sampling_params={"max_tokens": 5}), "invalid_grader", "grader.sampling_params.max_tokens"),
    (LABEL, "label_model_outside_multi", "grader.type"),
    (multi({"a": with_(LABEL, labels=[])}), "invalid_grader", "grader.graders.a.labels"),
    (multi({"a": with_(LABEL, labels=["x", "x"])}), "invalid_grader", "grader.graders.a.labels"),
    (
        multi({"a": with_(LABEL, passing_labels=["great"])}),
        "invalid_grader",
        "grader.graders.a.passing_labels",
    ),
    (multi({}), "invalid_grader", "grader.graders"),
    (multi([STRING_CHECK]), "invalid_grader", "grader.graders"),
    (multi({"a": STRING_CHECK, "b": {"type": "regex"}}), "unknown_grader_type", "grader.graders.b.type"),
    (multi({"a": multi({"b": STRING_CHECK}, "b")}), "nested_multi_grader", "grader.graders.a.type"),
    (multi({"a": STRING_CHECK}, "a + b"), "formula_parse_error", "grader.calculate_output"),
    (multi({"a": STRING_CHECK}, "a +"), "formula_parse_error", "grader.calculate_output"),
    (with_(multi({"a": STRING_CHECK}), calculate_output=None), "invalid_grader", "grader.calculate_output"),
    (multi({"a": with_(STRING_CHECK, input="{{ foo.bar }}")}), "invalid_template", "grader.graders.a.input"),
    (multi(with_(STRING_CHECK, name="a", operation="is")), "invalid_operation", "grader.graders.operation"),
]


@pytest.mark.parametrize(("obj", "code", "param"), CASES)
def test_refusals_name_their_field(obj: Any, code: str, param: str) -> None:
    with pytest.raises(GraderError) as caught:
        parse_grader(obj, allow_python=True)
    assert (caught.value.code, caught.value.param) == (code, param), caught.value.message
    assert caught.value.message


def test_every_code_is_exercised() -> None:
    exercised = {code for _, code, _ in CASES} | {"python_grader_disabled"}
    assert exercised == GRADER_ERROR_CODES


@pytest.mark.parametrize(
    ("obj", "param"),
    [(PYTHON, "grader.type"), (multi({"a": STRING_CHECK, "b": PYTHON}, "a + b"), "grader.graders.b.type")],
)
def test_python_graders_can_be_disabled(obj: dict[str, Any], param: str) -> None:
    with pytest.raises(GraderError) as caught:
        parse_grader(obj, allow_python=False)
    assert (caught.value.code, caught.value.param) == ("python_grader_disabled", param)


def test_param_prefix() -> None:
    with pytest.raises(GraderError) as caught:
        parse_grader({"type": "nope"}, allow_python=True, param="method.reinforcement.grader")
    assert caught.value.param == "method.reinforcement.grader.type"


def test_python_source_limit_is_in_utf8_bytes() -> None:
    body = "def grade(sample, item):\n    return 1.0\n#"
    fits = body + "x" * (MAX_SOURCE_BYTES - len(body))
    parse_grader(with_(PYTHON, source=fits), allow_python=True)
    with pytest.raises(GraderError):  # the same number of characters, two bytes each
        parse_grader(with_(PYTHON, source=body + "é" * (MAX_SOURCE_BYTES - len(body))), allow_python=True)


@pytest.mark.parametrize(
    "source",
    [
        "def grade(sample, item):\n    return 1.0\n",
        "grade = lambda sample, item: 1.0\n",
        "from my_helpers import grade\n",
        "from my_helpers import score as grade\n",
    ],
)
def test_python_source_binds_grade(source: str) -> None:
    assert parse_grader(with_(PYTHON, source=source), allow_python=True).to_json()["source"] == source


def test_both_forms_of_multi_graders() -> None:
    mapped = parse_grader(
        multi({"name": with_(STRING_CHECK, name="name_grader")}, "name"), allow_python=False
    )
    assert mapped.to_json() == {
        "type": "multi",
        "name": "m",
        "graders": {"name": {**STRING_CHECK, "name": "name_grader"}},
        "calculate_output": "name",
    }
    single = parse_grader(multi(with_(STRING_CHECK, name="exact"), "exact * 2"), allow_python=False)
    assert single.to_json()["graders"] == {"exact": {**STRING_CHECK, "name": "exact"}}
    unnamed = parse_grader(multi(with_(STRING_CHECK, name=None), "grader"), allow_python=False)
    assert unnamed.to_json()["graders"] == {"grader": {**STRING_CHECK, "name": "grader"}}


def test_normalised_json() -> None:
    assert (
        parse_grader(with_(STRING_CHECK, name=None), allow_python=False).to_json()["name"] == "string_check"
    )
    score = parse_grader(
        with_(
            SCORE, pass_threshold=0.5, sampling_params={"temperature": 0, "seed": 7, "reasoning_effort": None}
        ),
        allow_python=False,
    ).to_json()
    assert score == {
        **SCORE,
        "range": [0.0, 1.0],
        "sampling_params": {"temperature": 0.0, "seed": 7},
        "pass_threshold": 0.5,
    }
    message = {
        "role": "system",
        "type": "message",
        "content": [{"type": "input_text", "text": "hi"}, "there"],
    }
    assert parse_grader(with_(SCORE, input=[message]), allow_python=False).to_json()["input"] == [message]
    python = parse_grader(with_(PYTHON, image_tag="2025-05-08"), allow_python=True).to_json()
    assert python == {**PYTHON, "image_tag": "2025-05-08"}
    label = parse_grader(multi({"a": LABEL}), allow_python=False).to_json()["graders"]["a"]
    assert label == LABEL
    assert parse_grader(SIMILARITY, allow_python=False).to_json() == SIMILARITY
