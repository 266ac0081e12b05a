"""Templates: what {{ }} paths render to, what fails a sample, and what is refused when parsed."""

from __future__ import annotations

import random
import re
import time

import pytest

from graders import GraderError, make_sample, templates
from graders.results import GradeFailure
from graders.templates import MAX_RENDERED_CHARS, MAX_TEMPLATE_CHARS, Template

ITEM = {
    "answer": "Paris",
    "n": 3,
    "x": 1.5,
    "ok": True,
    "none": None,
    "a": {"b": {"c": "deep"}},
    "rows": [10, 20],
}


def render(source: str, output_text: str = '{"city": "Paris", "tags": ["a", "b"]}') -> str:
    return Template.parse(source, "grader.input").render(make_sample(output_text), ITEM)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{{item.answer}}", "Paris"),
        ("{{ item.answer }}", "Paris"),  # spaces inside the braces, as OpenAI's examples write them
        ("The capital is {{item.answer}}.", "The capital is Paris."),
        ("{{item.a.b.c}}", "deep"),
        ("{{item.rows[1]}}", "20"),
        ("{{item.rows.0}}", "10"),
        ("{{item.n}}/{{item.x}}", "3/1.5"),
        ("{{item.ok}} {{item.none}}", "true null"),
        ("{{item.a}}", '{"b": {"c": "deep"}}'),
        ("{{item.rows}}", "[10, 20]"),
        ("{{sample.output_text}}", '{"city": "Paris", "tags": ["a", "b"]}'),
        ("{{sample.output_json.city}}", "Paris"),
        ("{{sample.output_json.tags[0]}}{{sample.output_json.tags[1]}}", "ab"),
        ("{{sample.output_tools}}", "[]"),
        ("no variables at all", "no variables at all"),
        ("", ""),
    ],
)
def test_renders(source: str, expected: str) -> None:
    assert render(source) == expected


def test_tool_call_paths() -> None:
    sample = make_sample("", output_tools=[{"function": {"name": "get_weather", "arguments": "{}"}}])
    template = Template.parse("{{sample.output_tools[0].function.name}}", "grader.reference")
    assert template.render(sample, {}) == "get_weather"


@pytest.mark.parametrize(
    ("source", "flag", "details"),
    [
        ("{{item.missing}}", "invalid_variable_error", "item.missing not found"),
        ("{{item.a.b.x}}", "invalid_variable_error", "item.a.b.x not found"),
        ("{{item.rows[2]}}", "invalid_variable_error", "item.rows[2] not found"),
        ("{{item.answer.length}}", "invalid_variable_error", "item.answer.length not found"),
        ("{{sample.output_json.missing}}", "invalid_variable_error", "sample.output_json.missing not found"),
        ("{{sample.output_audio}}", "invalid_variable_error", "sample.output_audio not found"),
    ],
)
def test_missing_values_fail_the_sample(source: str, flag: str, details: str) -> None:
    with pytest.raises(GradeFailure) as caught:
        render(source)
    assert caught.value.errors.flags == [flag]
    assert str(caught.value) == details


@pytest.mark.parametrize("output_text", ["Paris", "[1, 2]", '"just a string"', "{not json", ""])
def test_output_json_of_an_answer_that_is_no_json_object_is_a_sample_parse_error(output_text: str) -> None:
    assert make_sample(output_text)["output_json"] is None
    with pytest.raises(GradeFailure) as caught:
        render("{{sample.output_json.city}}", output_text)
    assert caught.value.errors.flags == ["sample_parse_error"]


def test_make_sample() -> None:
    assert make_sample('{"a": 1}') == {
        "output_text": '{"a": 1}',
        "output_json": {"a": 1},
        "output_tools": [],
        "choices": [],
    }


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("{{ other.answer }}", "unknown namespace 'other'"),
        ("{{ answer }}", "is not {{ item.path }}"),
        ("{{ item }}", "is not {{ item.path }}"),
        ("{{}}", "is not {{ item.path }}"),
        ("{{ item. }}", "is not {{ item.path }}"),
        ("{{ item.a b }}", "is not {{ item.path }}"),
        ("{{ item.rows[x] }}", "is not {{ item.path }}"),
        ("{{ sample.output }}", "sample has no 'output'"),
        ("ok {{item.a}} then {{ itme.b }}", "unknown namespace 'itme'"),
    ],
)
def test_bad_templates_are_refused_when_parsed(source: str, why: str) -> None:
    with pytest.raises(GraderError) as caught:
        Template.parse(source, "grader.graders.a.input")
    assert (caught.value.code, caught.value.param) == ("invalid_template", "grader.graders.a.input")
    assert why in caught.value.message


def test_a_template_that_fills_in_past_the_cap_fails_its_sample_without_building_the_text() -> None:
    """2,000 copies of a 1,000-character item value would be 2 MB; the sample fails at the cap instead."""
    template = Template.parse("{{item.text}} " * 2000, "grader.input")
    assert template.render({}, {"text": "x" * 100}) == ("x" * 100 + " ") * 2000  # 202 kB: under the cap
    with pytest.raises(GradeFailure) as caught:
        template.render({}, {"text": "x" * 1000})
    assert caught.value.errors.flags == ["other_error"]
    assert str(caught.value) == f"the template fills in to over {MAX_RENDERED_CHARS} characters"


def test_a_template_full_of_open_braces_parses_in_one_pass() -> None:
    """The hostile payload: "{{" thousands of times. A backtracking regex scanned to the end from every
    "{{" (40k characters took 14 s, holding the interpreter lock, so the whole API stalled); one pass
    takes microseconds. The bound is 30x slack on a busy machine, the old scan took over 20 s here."""
    source = "{{" * (MAX_TEMPLATE_CHARS // 2)
    started = time.perf_counter()
    assert Template.parse(source, "grader.input").parts == (source,)  # no "}}": all literal text
    with pytest.raises(GraderError):  # the first "{{" runs to the "}}": not a path
        Template.parse(source[:-2] + "}}", "grader.input")
    assert time.perf_counter() - started < 1.0


def test_a_template_over_the_length_cap_is_refused_naming_the_field() -> None:
    with pytest.raises(GraderError) as caught:
        Template.parse("x" * (MAX_TEMPLATE_CHARS + 1), "grader.graders.a.input")
    assert (caught.value.code, caught.value.param) == ("template_too_long", "grader.graders.a.input")
    assert Template.parse("x" * MAX_TEMPLATE_CHARS, "grader.input").parts == ("x" * MAX_TEMPLATE_CHARS,)


def test_the_one_pass_scan_finds_the_tags_a_lazy_regex_finds() -> None:
    """The regex it replaced is the oracle: leftmost "{{", then the nearest "}}" after it."""
    oracle = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choice("{}a.\n") for _ in range(rng.randint(0, 16)))
        expected = [(m.start(), m.end()) for m in oracle.finditer(text)]
        assert templates._tags(text) == expected, text
