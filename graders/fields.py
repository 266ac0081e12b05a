"""Reading one grader's JSON object field by field, so every refusal names the field it is about."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from graders.errors import GraderError


class JsonFields:
    """A JSON object at `param` (a dotted path from "grader"), read with checks that raise GraderError."""

    def __init__(self, obj: Any, param: str) -> None:
        if not isinstance(obj, dict):
            raise GraderError("invalid_grader", f"{param} must be an object", param)
        self.obj: dict[str, Any] = obj
        self.param = param

    def at(self, key: str) -> str:
        return f"{self.param}.{key}"

    def only(self, allowed: Iterable[str]) -> None:
        """Refuse fields the type does not have: a typo ("refrence") is an error, not a silent default."""
        extra = sorted(set(self.obj) - set(allowed))
        if extra:
            raise GraderError("invalid_grader", f"unknown field {extra[0]!r}", self.at(extra[0]))

    def has(self, key: str) -> bool:
        return self.obj.get(key) is not None

    def required(self, key: str) -> Any:
        if self.obj.get(key) is None:
            raise GraderError("invalid_grader", f"{self.at(key)} is required", self.at(key))
        return self.obj[key]

    def string(self, key: str, default: str | None = None) -> str:
        if default is not None and not self.has(key):
            return default
        value = self.required(key)
        if not isinstance(value, str):
            raise GraderError("invalid_grader", f"{self.at(key)} must be a string", self.at(key))
        return value

    def number(self, key: str) -> float:
        return number(self.required(key), self.at(key))

    def choice(self, key: str, allowed: Iterable[str], code: str) -> str:
        value = self.string(key)
        options = list(allowed)
        if value not in options:
            raise GraderError(code, f"{self.at(key)} must be one of {', '.join(options)}", self.at(key))
        return value


def number(value: Any, param: str) -> float:
    """A finite JSON number (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise GraderError("invalid_grader", f"{param} must be a finite number", param)
    return float(value)
