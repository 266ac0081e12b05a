"""A problem with one line of an upload, and how a user's value is named in its message.

Shared by the line checks (core.data.line_checks, conversation, tools, parts) and the streaming validator.
"""

from __future__ import annotations

import json
from typing import Any


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


def checked_string(value: Any, field: str, strict: bool, *, required: bool = True) -> str:
    """`value` as a string; raise for a missing, non-string or blank one (null is "" when not required).
    `strict`: also refuse lone surrogate escapes (\\ud800), which decode to a str that cannot be encoded."""
    if value is None:
        if required:
            raise LineProblem("missing_field", "is required", field)
        return ""
    if type(value) is not str:
        raise LineProblem("wrong_type", f"must be a string; got {json_type(value)}", field)
    if required and (not value or value.isspace()):
        raise LineProblem("empty_content", "must not be empty", field)
    if strict:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            msg = "contains an unpaired surrogate escape such as \\ud800 (not valid Unicode)"
            raise LineProblem("invalid_utf8", msg, field) from None
    return value
