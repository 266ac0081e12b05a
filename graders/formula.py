"""multi's calculate_output: + - * / ^, parentheses, unary minus, numbers, grader names and
min max abs floor ceil exp sqrt log (natural), as OpenAI's graders guide lists them.

A tokenizer and a recursive-descent parser compile the text into closures: nothing is ever eval'd. ^ binds
tightest and to the right (-2^2 is -4, 2^3^2 is 512). Errors in the text are found when the grader is
parsed; arithmetic that fails on a sample's values (x/0, log(0), sqrt(-1), overflow, a non-finite result)
raises FormulaError, which the multi grader reports as formula_parse_error (OpenAI's one formula flag) with
reward 0."""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NoReturn

from graders.errors import GraderError

Values = Mapping[str, float]
Node = Callable[[Values], float]

_TOKEN = re.compile(r"\s*(?:(\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)|([A-Za-z_]\w*)|(\S))")
_UNARY: dict[str, Callable[[float], float]] = {
    "abs": abs,
    "floor": math.floor,
    "ceil": math.ceil,
    "exp": math.exp,
    "sqrt": math.sqrt,
    "log": math.log,
}
_VARIADIC: dict[str, Callable[..., float]] = {"min": min, "max": max}
FUNCTIONS = frozenset(_UNARY) | frozenset(_VARIADIC)
_MAX_DEPTH = 64  # nesting of parentheses, calls and unary signs: bounds the parser's recursion
_MAX_LENGTH = 4096


class FormulaError(ArithmeticError):
    """The formula has no finite value for these sub-rewards."""


@dataclass(frozen=True)
class Formula:
    source: str
    names: frozenset[str]  # the grader names it reads
    _root: Node

    @classmethod
    def parse(cls, source: str, known_names: frozenset[str], param: str) -> Formula:
        parser = _Parser(source, known_names, param)
        root = parser.expression()
        if parser.peek() is not None:
            parser.fail(f"unexpected {parser.peek()!r}")
        return cls(source, frozenset(parser.used), root)

    def evaluate(self, values: Values) -> float:
        try:
            result = float(self._root(values))
        except (ArithmeticError, ValueError) as exc:  # ZeroDivisionError, OverflowError, math domain
            raise FormulaError(f"{self.source}: {exc}") from exc
        if not math.isfinite(result):
            raise FormulaError(f"{self.source}: the result is not finite")
        return result


class _Parser:
    def __init__(self, source: str, known_names: frozenset[str], param: str) -> None:
        self.source, self.known, self.param = source, known_names, param
        if len(source) > _MAX_LENGTH:
            self.fail(f"longer than {_MAX_LENGTH} characters")
        self.tokens: list[str] = []
        self.kinds: list[str] = []
        for match in _TOKEN.finditer(source):
            number, name, symbol = match.groups()
            if symbol is not None and symbol not in "+-*/^(),":
                self.fail(f"unexpected character {symbol!r}")
            self.tokens.append(number or name or symbol)
            self.kinds.append("number" if number else "name" if name else "symbol")
        self.position = 0
        self.depth = 0
        self.used: set[str] = set()

    def fail(self, why: str) -> NoReturn:
        raise GraderError("formula_parse_error", f"calculate_output {self.source!r}: {why}", self.param)

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            self.fail("ends too soon")
        self.position += 1
        return token

    def expect(self, token: str) -> None:
        if self.take() != token:
            self.fail(f"expected {token!r}")

    def deeper(self) -> None:
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            self.fail(f"nested deeper than {_MAX_DEPTH}")

    def expression(self) -> Node:
        first, rest = self.term(), []
        while self.peek() in ("+", "-"):
            op = _BINARY[self.take()]
            rest.append((op, self.term()))
        return _chain(first, rest)

    def term(self) -> Node:
        first, rest = self.unary(), []
        while self.peek() in ("*", "/"):
            op = _BINARY[self.take()]
            rest.append((op, self.unary()))
        return _chain(first, rest)

    def unary(self) -> Node:
        if self.peek() in ("-", "+"):
            op = self.take()
            self.deeper()
            operand = self.unary()
            self.depth -= 1
            return _neg(operand) if op == "-" else operand
        base = self.atom()
        if self.peek() == "^":
            self.take()
            self.deeper()
            exponent = self.unary()  # right-associative, and 2^-1 reads as 2^(-1)
            self.depth -= 1
            return _pow(base, exponent)
        return base

    def atom(self) -> Node:
        index = self.position
        token = self.take()
        kind = self.kinds[index]
        if kind == "number":
            value = float(token)
            return lambda values: value
        if token == "(":
            self.deeper()
            node = self.expression()
            self.expect(")")
            self.depth -= 1
            return node
        if kind == "name" and self.peek() == "(":
            return self.call(token)
        if kind == "name":
            if token not in self.known:
                known = ", ".join(sorted(self.known)) or "none"
                self.fail(f"unknown name {token!r} (graders: {known})")
            self.used.add(token)
            return lambda values: values[token]
        self.fail(f"unexpected {token!r}")

    def call(self, function: str) -> Node:
        if function not in FUNCTIONS:
            self.fail(f"unknown function {function!r} (functions: {', '.join(sorted(FUNCTIONS))})")
        self.expect("(")
        self.deeper()
        args = [self.expression()]
        while self.peek() == ",":
            self.take()
            args.append(self.expression())
        self.expect(")")
        self.depth -= 1
        if function in _VARIADIC:
            combine = _VARIADIC[function]
            return lambda values: combine(arg(values) for arg in args)
        if len(args) != 1:
            self.fail(f"{function}() takes one argument, not {len(args)}")
        apply, (arg,) = _UNARY[function], args
        return lambda values: float(apply(arg(values)))


_BINARY: dict[str, Callable[[float, float], float]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
}


def _chain(first: Node, rest: list[tuple[Callable[[float, float], float], Node]]) -> Node:
    """a op b op c ..., left to right in a loop: a chain of 2,000 terms nested as closures would recurse
    2,000 deep when evaluated (past Python's recursion limit); only nesting (_MAX_DEPTH) recurses."""
    if not rest:
        return first

    def evaluate(values: Values) -> float:
        total = first(values)
        for op, node in rest:
            total = op(total, node(values))
        return total

    return evaluate


def _neg(a: Node) -> Node:
    return lambda v: -a(v)


def _pow(a: Node, b: Node) -> Node:
    return lambda v: math.pow(a(v), b(v))  # math.pow: a ValueError where ** would give a complex number
