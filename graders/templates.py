"""`{{ item.path }}` / `{{ sample.field.path }}` strings: checked when a grader is parsed, filled per sample.

A path is dotted keys with optional list indexes: {{ item.a.b }}, {{ sample.output_tools[0].function.name }}.
A missing value is the sample's failure (invalid_variable_error), and sample.output_json on an answer that
is not a JSON object a sample_parse_error; both score 0. Strings are inserted as they are, numbers with
str(), and objects, lists, booleans and null as JSON. A template that fills in to more than
MAX_RENDERED_CHARS (one repeating {{ item.text }} thousands of times, say) fails its sample (other_error)
before the text is built: a tenant's grader cannot make a training step's grading hold gigabytes.

A template's own text is capped (MAX_TEMPLATE_CHARS, template_too_long) and scanned in one pass with
str.find, never a backtracking regex over the whole text: the lazy regex it replaced took 62 s on 80k of
"{{" (each "{{" scanned to the end for a "}}"), holding the interpreter lock and so every request of the
API. Templates are parsed wherever graders are (API, planner, training), so the cap holds everywhere."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from graders.errors import GraderError
from graders.results import GradeFailure
from graders.sample import SAMPLE_FIELDS

_PATH = re.compile(r"\s*([A-Za-z_]\w*)((?:\.[^.\[\]\s{}]+|\[\d+\])+)\s*$")
_STEP = re.compile(r"\.([^.\[\]\s{}]+)|\[(\d+)\]")

Step = str | int
MAX_RENDERED_CHARS = 256 * 1024  # one template, filled in for one sample
MAX_TEMPLATE_CHARS = 64 * 1024  # one template as written (a judge prompt with examples fits many times)


@dataclass(frozen=True)
class Template:
    """A string with {{ }} variables; `parts` alternates literal text and variable paths."""

    source: str
    parts: tuple[str | tuple[Step, ...], ...]

    @classmethod
    def parse(cls, source: str, param: str) -> Template:
        if len(source) > MAX_TEMPLATE_CHARS:
            raise GraderError(
                "template_too_long", f"{param} is longer than {MAX_TEMPLATE_CHARS} characters", param
            )
        parts: list[str | tuple[Step, ...]] = []
        position = 0
        for start, end in _tags(source):
            parts.append(source[position:start])
            parts.append(_parse_path(source[start + 2 : end - 2], param))
            position = end
        parts.append(source[position:])
        return cls(source, tuple(part for part in parts if part != ""))

    def render(self, sample: dict[str, Any], item: dict[str, Any]) -> str:
        pieces, length = [], 0
        for part in self.parts:
            piece = part if isinstance(part, str) else _as_text(lookup(part, sample, item))
            length += len(piece)
            if length > MAX_RENDERED_CHARS:
                raise GradeFailure(
                    "other_error", f"the template fills in to over {MAX_RENDERED_CHARS} characters"
                )
            pieces.append(piece)
        return "".join(pieces)


def _tags(source: str) -> list[tuple[int, int]]:
    """(start, end) of each {{ ... }}: the leftmost "{{", then the nearest "}}" after it. One pass: once
    no "}}" follows a "{{", none follows any later one either."""
    tags, position = [], 0
    while (start := source.find("{{", position)) >= 0:
        close = source.find("}}", start + 2)
        if close < 0:
            break
        tags.append((start, close + 2))
        position = close + 2
    return tags


def _parse_path(text: str, param: str) -> tuple[Step, ...]:
    match = _PATH.match(text)
    if match is None:
        raise GraderError(
            "invalid_template", f"{{{{{text}}}}} is not {{{{ item.path }}}} or {{{{ sample.path }}}}", param
        )
    namespace, rest = match.groups()
    if namespace not in ("item", "sample"):
        raise GraderError(
            "invalid_template", f"unknown namespace {namespace!r}: templates name item or sample", param
        )
    steps: list[Step] = [namespace]
    steps += [int(index) if index else key for key, index in _STEP.findall(rest)]
    if namespace == "sample" and steps[1] not in SAMPLE_FIELDS:
        raise GraderError(
            "invalid_template", f"sample has no {steps[1]!r}: it has {', '.join(SAMPLE_FIELDS)}", param
        )
    return tuple(steps)


def lookup(path: tuple[Step, ...], sample: dict[str, Any], item: dict[str, Any]) -> Any:
    """The value at `path`, or GradeFailure naming what was missing."""
    value: Any = sample if path[0] == "sample" else item
    if path[:2] == ("sample", "output_json") and sample.get("output_json") is None:
        raise GradeFailure("sample_parse_error", "sample.output_json: the answer is not a JSON object")
    for depth, step in enumerate(path[1:], start=2):
        index = step if isinstance(step, int) else int(step) if step.isdigit() else None
        if isinstance(value, dict) and isinstance(step, str) and step in value:
            value = value[step]
        elif isinstance(value, list) and index is not None and index < len(value):
            value = value[index]
        else:
            raise GradeFailure("invalid_variable_error", f"{_show(path[:depth])} not found")
    return value


def _show(path: tuple[Step, ...]) -> str:
    return "".join(f"[{s}]" if isinstance(s, int) else (s if i == 0 else f".{s}") for i, s in enumerate(path))


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return json.dumps(value, ensure_ascii=False)
