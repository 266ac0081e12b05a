"""Checks of one parsed JSONL line against its format: the first problem found ends the line's checks.

Used by core.data's streaming validator; each problem carries a stable code and the JSON path of the field.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from core.data.examples import Format

ROLES = ("system", "user", "assistant")


class Checked(NamedTuple):
    """What the stats and the duplicate set need from a valid line."""

    chars: int  # characters of content
    messages: int
    key: tuple[Any, ...]  # the used fields: equal keys are duplicate examples
    flag: bool  # chat: starts with a system message; instruction: has a non-empty input


class LineProblem(Exception):
    """One problem that ends the checks of a line (its structure cannot be trusted past it)."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.field = code, message, field


def json_type(value: Any) -> str:
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"


def show(value: Any, limit: int = 40) -> str:
    """A short rendering of a user value for a message: scalars as JSON, containers by type."""
    text = json_type(value) if isinstance(value, (dict, list)) else json.dumps(value)
    return text if len(text) <= limit else text[: limit - 4] + '..."'


def partial_format(obj: dict[str, Any]) -> Format | None:
    """A format a line meant to have but lacks a required key of, for a missing_field message."""
    if "instruction" in obj or "output" in obj:
        return "instruction"
    if "prompt" in obj or "completion" in obj:
        return "prompt_completion"
    return None


def unknown_format_message(obj: dict[str, Any], reverse: dict[str, str]) -> str:
    keys = ", ".join(show(k) for k in list(obj)[:10]) + (", ..." if len(obj) > 10 else "")
    expected = [
        ("chat", "messages"),
        ("instruction", "instruction + output"),
        ("prompt_completion", "prompt + completion"),
        ("text", "text"),
    ]
    alts = "; ".join(f"{name}: {keys_}" for name, keys_ in expected)
    hint = "" if reverse else " (or pass a column_mapping)"
    return f"no known format: expected keys for {alts}{hint}; got keys [{keys}]"


def _path(key: str, at: int | None) -> str:
    """JSON path of a field, built only for a problem: "output" or "messages[2].content"."""
    return key if at is None else f"messages[{at}].{key}"


def _text(
    obj: dict[str, Any], key: str, strict: bool, *, at: int | None = None, required: bool = True
) -> str:
    """The string at obj[key]; raise for a missing, non-string or blank value (null is absent if optional)."""
    value = obj.get(key)
    if value is None:
        if required:
            raise LineProblem("missing_field", "is required", _path(key, at))
        return ""
    if type(value) is not str:
        raise LineProblem("wrong_type", f"must be a string; got {json_type(value)}", _path(key, at))
    if required and (not value or value.isspace()):
        raise LineProblem("empty_content", "must not be empty", _path(key, at))
    if strict:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            msg = "contains an unpaired surrogate escape such as \\ud800 (not valid Unicode)"
            raise LineProblem("invalid_utf8", msg, _path(key, at)) from None
    return value


def check_flat(obj: dict[str, Any], fmt: Format, strict: bool) -> Checked:
    """Check an instruction, prompt_completion or text line; flag: an instruction has an input."""
    values: tuple[str, ...]
    has_input = False
    if fmt == "instruction":
        values = (
            _text(obj, "instruction", strict),
            _text(obj, "input", strict, required=False),
            _text(obj, "output", strict),
        )
        has_input = bool(values[1])
    elif fmt == "prompt_completion":
        values = (_text(obj, "prompt", strict), _text(obj, "completion", strict))
    else:
        values = (_text(obj, "text", strict),)
    # Only used fields make an example: extra keys (ids, metadata) do not hide a duplicate.
    return Checked(sum(map(len, values)), 1 if fmt == "text" else 2, (fmt, *values), has_input)


def check_chat(obj: dict[str, Any], strict: bool) -> Checked:
    """Check a chat line; flag: it starts with a system message."""
    messages = obj["messages"]
    if type(messages) is not list:
        raise LineProblem("wrong_type", f"must be an array; got {json_type(messages)}", "messages")
    if not messages:
        raise LineProblem("empty_content", "must not be empty", "messages")
    first = messages[0]
    system_first = type(first) is dict and first.get("role") == "system"
    chars = 0
    assistant = False
    canon: list[tuple[str, str, int | None]] = []
    for i, m in enumerate(messages):
        if type(m) is not dict:
            raise LineProblem("wrong_type", f"must be an object; got {json_type(m)}", f"messages[{i}]")
        role = _role(m, i, system_first)
        content = _text(m, "content", strict, at=i)
        weight = m.get("weight")
        if weight is not None and (type(weight) is not int or weight not in (0, 1)):
            raise LineProblem("wrong_type", f"must be 0 or 1; got {show(weight)}", _path("weight", i))
        chars += len(content)
        assistant = assistant or role == "assistant"
        canon.append((role, content, weight))
    if not assistant:
        raise LineProblem(
            "no_assistant_turn", "has no assistant message; at least one is required", "messages"
        )
    return Checked(chars, len(messages), tuple(canon), system_first)


def _role(m: dict[str, Any], i: int, system_first: bool) -> str:
    """The role of messages[i]: known, and in order (optional system first, then user/assistant alternate)."""
    role = m.get("role")
    if i == 0 and system_first:
        return "system"
    # The happy path: the role the position asks for.
    expected = "user" if (i - system_first) % 2 == 0 else "assistant"
    if role == expected:
        return role
    if role is None:
        raise LineProblem("missing_field", "is required", _path("role", i))
    if type(role) is not str:
        raise LineProblem("wrong_type", f"must be a string; got {json_type(role)}", _path("role", i))
    if role not in ROLES:
        raise LineProblem(
            "unknown_role", f"must be one of {', '.join(ROLES)}; got {show(role)}", _path("role", i)
        )
    raise LineProblem(
        "roles_not_alternating",
        f'must be "{expected}" (after an optional first system message, roles alternate '
        f"user, assistant, user, ...); got {show(role)}",
        _path("role", i),
    )
