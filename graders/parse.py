"""parse_grader: a grader JSON, checked whole before any sample is graded, into a Grader."""

from __future__ import annotations

from typing import Any

from graders.base import Grader
from graders.errors import GraderError
from graders.fields import JsonFields
from graders.formula import Formula
from graders.model_graders import LabelModelGrader, ScoreModelGrader
from graders.multi import MultiGrader
from graders.python_code import PythonGrader
from graders.string_check import StringCheckGrader
from graders.text_similarity import TextSimilarityGrader

GRADER_TYPES = ("string_check", "text_similarity", "score_model", "label_model", "python", "multi")
# JSON values (objects, lists, strings, numbers...) in one grader: a real one has tens (OpenAI's examples)
# to a few hundred. The bound keeps parsing a 1 MiB body to milliseconds, wherever graders are parsed.
MAX_GRADER_NODES = 2000


def parse_grader(obj: Any, *, allow_python: bool, param: str = "grader") -> Grader:
    """The Grader for `obj`, or GraderError naming the first field at fault (`param` is the path of `obj`).
    `allow_python`: whether this server runs python graders (python_grader_disabled where not)."""
    check_size(obj, param)
    return _parse(obj, param, allow_python=allow_python, in_multi=False, default_name=None)


def check_size(obj: Any, param: str = "grader") -> None:
    """Refuse a grader of more than MAX_GRADER_NODES JSON values, counting no further than that: call it
    before a model copies the value whole (pydantic's dict[str, Any] does, on the event loop)."""
    pending, seen = [obj], 0
    while pending:
        value = pending.pop()
        seen += 1
        if seen > MAX_GRADER_NODES:
            raise GraderError(
                "grader_too_large", f"{param} holds more than {MAX_GRADER_NODES} JSON values", param
            )
        if isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)


def _parse(obj: Any, param: str, *, allow_python: bool, in_multi: bool, default_name: str | None) -> Grader:
    fields = JsonFields(obj, param)
    kind = fields.obj.get("type")
    if kind not in GRADER_TYPES:
        why = "is required" if kind is None else f"{kind!r} is not one of {', '.join(GRADER_TYPES)}"
        raise GraderError("unknown_grader_type", f"{fields.at('type')} {why}", fields.at("type"))
    name = default_name or kind
    if kind == "string_check":
        return StringCheckGrader.from_json(fields, name)
    if kind == "text_similarity":
        return TextSimilarityGrader.from_json(fields, name)
    if kind == "score_model":
        return ScoreModelGrader.from_json(fields, name)
    if kind == "python":
        return PythonGrader.from_json(fields, name, allow_python)
    if kind == "label_model":
        if not in_multi:
            raise GraderError(
                "label_model_outside_multi",
                "a label_model grader runs only inside a multi grader",
                fields.at("type"),
            )
        return LabelModelGrader.from_json(fields, name)
    if in_multi:
        raise GraderError(
            "nested_multi_grader", "a multi grader cannot hold another multi grader", fields.at("type")
        )
    return _multi(fields, name, allow_python)


def _multi(fields: JsonFields, name: str, allow_python: bool) -> MultiGrader:
    """`graders` is a map {name: grader} (OpenAI's guide, what the service sends), or a single grader
    object (what the openai SDK's type declares), keyed by its name ("grader" when it has none)."""
    fields.only(("type", "name", "graders", "calculate_output"))
    graders_param = fields.at("graders")
    given = fields.required("graders")
    if isinstance(given, dict) and isinstance(given.get("type"), str):
        key = given["name"] if isinstance(given.get("name"), str) else "grader"
        children: dict[str, tuple[Any, str]] = {key: (given, graders_param)}
    elif isinstance(given, dict) and given:
        children = {str(key): (child, f"{graders_param}.{key}") for key, child in given.items()}
    else:
        raise GraderError(
            "invalid_grader", f"{graders_param} must be a non-empty map of graders", graders_param
        )
    graders = {
        key: _parse(child, param, allow_python=allow_python, in_multi=True, default_name=key)
        for key, (child, param) in children.items()
    }
    formula = Formula.parse(
        fields.string("calculate_output"), frozenset(graders), fields.at("calculate_output")
    )
    return MultiGrader(name=fields.string("name", name), graders=graders, calculate_output=formula)
