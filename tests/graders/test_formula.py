"""multi's calculate_output: every operator and function, precedence, and the errors of each kind."""

from __future__ import annotations

import math

import pytest

from graders import GraderError
from graders.formula import Formula, FormulaError

NAMES = frozenset({"a", "b", "c", "name_grader"})
VALUES = {"a": 0.5, "b": 2.0, "c": -3.0, "name_grader": 0.25}
PARAM = "grader.calculate_output"


def value(source: str, values: dict[str, float] = VALUES) -> float:
    return Formula.parse(source, NAMES, PARAM).evaluate(values)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("a + b", 2.5),
        ("b - a", 1.5),
        ("a * b", 1.0),
        ("a / b", 0.25),
        ("b ^ 3", 8.0),
        ("-a", -0.5),
        ("+a", 0.5),
        ("--a", 0.5),
        ("(a + b) * 2", 5.0),
        ("a + b * 2", 4.5),
        ("1 - 2 - 3", -4.0),  # left-associative
        ("8 / 4 / 2", 1.0),
        ("2 ^ 3 ^ 2", 512.0),  # right-associative
        ("-2 ^ 2", -4.0),  # ^ binds tighter than unary minus
        ("2 ^ -1", 0.5),
        ("(-2) ^ 2", 4.0),
        ("b ^ 0.5", math.sqrt(2.0)),
        ("0.5 * name_grader + 0.5 * a", 0.375),
        ("1e-1 + .5 + 2.", 2.6),
        ("min(a, b)", 0.5),
        ("max(a, b, c)", 2.0),
        ("min(c)", -3.0),
        ("abs(c)", 3.0),
        ("floor(2.7)", 2.0),
        ("floor(-2.5)", -3.0),
        ("ceil(2.1)", 3.0),
        ("ceil(-2.5)", -2.0),
        ("exp(1)", math.e),
        ("sqrt(b)", math.sqrt(2.0)),
        ("log(exp(2))", 2.0),
        ("log(b)", math.log(2.0)),
        ("max(min(a, b), abs(c)) / (1 + floor(a))", 3.0),
        ("  a  ", 0.5),
        ("3", 3.0),
    ],
)
def test_values(source: str, expected: float) -> None:
    assert value(source) == pytest.approx(expected, abs=1e-12)


def test_names_it_reads() -> None:
    assert Formula.parse("a + max(b, 1)", NAMES, PARAM).names == {"a", "b"}


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("a + d", "unknown name 'd'"),
        ("pow(a, 2)", "unknown function 'pow'"),
        ("abs(a, b)", "abs() takes one argument"),
        ("a +", "ends too soon"),
        ("", "ends too soon"),
        ("(a + b", "ends too soon"),
        ("a + b)", "unexpected ')'"),
        ("a b", "unexpected 'b'"),
        ("a ** 2", "unexpected '*'"),
        ("a % 2", "unexpected character '%'"),
        ("a; import os", "unexpected character ';'"),
        ("__import__('os')", "unexpected character"),
        ("max()", "unexpected ')'"),
        ("min(a,)", "unexpected ')'"),
        ("1.2.3", "unexpected '.3'"),
        ("(" * 100 + "a" + ")" * 100, "nested deeper than 64"),
        ("-" * 100 + "a", "nested deeper than 64"),
        ("a + " * 2000 + "a", "longer than 4096"),
    ],
)
def test_refused_when_parsed(source: str, why: str) -> None:
    with pytest.raises(GraderError) as caught:
        Formula.parse(source, NAMES, PARAM)
    assert (caught.value.code, caught.value.param) == ("formula_parse_error", PARAM)
    assert why in caught.value.message


@pytest.mark.parametrize(
    ("source", "values"),
    [
        ("a / b", {"a": 1.0, "b": 0.0}),
        ("log(a)", {"a": 0.0}),
        ("log(a)", {"a": -1.0}),
        ("sqrt(a)", {"a": -1.0}),
        ("a ^ 0.5", {"a": -8.0}),  # no complex numbers
        ("exp(a)", {"a": 1000.0}),  # overflow
        ("b ^ a", {"a": 5000.0, "b": 10.0}),
        ("a * 1e308 * 10", {"a": 1.0}),  # inf
    ],
)
def test_no_finite_value_is_a_formula_error(source: str, values: dict[str, float]) -> None:
    with pytest.raises(FormulaError):
        value(source, {**VALUES, **values})


def test_a_formula_of_two_thousand_terms_evaluates_without_deep_recursion() -> None:
    """Every term of a + b + ... once nested a closure in the next: ~1,500 terms passed Python's recursion
    limit when evaluated (a 500 on /run, an uncaught error in training). Chains are loops now."""
    sums = "+".join(["a"] * 2048)  # 4,095 characters: the longest formula allowed
    assert Formula.parse(sums, frozenset({"a"}), "f").evaluate({"a": 0.5}) == 1024.0
    products = "*".join(["a"] * 1024) + "-" + "/".join(["b"] * 1000)
    assert Formula.parse(products, frozenset({"a", "b"}), "f").evaluate({"a": 1.0, "b": 1.0}) == 0.0
