"""string_check: 1 or 0 by comparing two templated strings (eq, ne, like: contains, ilike: contains
ignoring case), as OpenAI's graders guide defines the operations."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from graders.base import GradeContext, Grader, Item, Sample, Scored
from graders.fields import JsonFields
from graders.templates import Template

OPERATIONS: dict[str, Callable[[str, str], bool]] = {
    "eq": lambda given, reference: given == reference,
    "ne": lambda given, reference: given != reference,
    "like": lambda given, reference: reference in given,
    "ilike": lambda given, reference: reference.casefold() in given.casefold(),
}


@dataclass(frozen=True)
class StringCheckGrader(Grader):
    type: ClassVar[str] = "string_check"
    name: str
    input: Template
    reference: Template
    operation: str

    @classmethod
    def from_json(cls, fields: JsonFields, default_name: str) -> StringCheckGrader:
        fields.only(("type", "name", "input", "reference", "operation"))
        return cls(
            name=fields.string("name", default_name),
            input=Template.parse(fields.string("input"), fields.at("input")),
            reference=Template.parse(fields.string("reference"), fields.at("reference")),
            operation=fields.choice("operation", OPERATIONS, "invalid_operation"),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "name": self.name,
            "input": self.input.source,
            "reference": self.reference.source,
            "operation": self.operation,
        }

    def score(self, sample: Sample, item: Item, ctx: GradeContext) -> Scored:
        given, reference = self.input.render(sample, item), self.reference.render(sample, item)
        return Scored(1.0 if OPERATIONS[self.operation](given, reference) else 0.0)
