"""text_similarity: how close the templated input is to the templated reference, by one metric
(metrics.py says which library computes each). cosine is refused when the grader is parsed: OpenAI offers
it to evals only (an embedding model), never to fine-tuning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from graders.base import GradeContext, Grader, Item, Sample, Scored
from graders.errors import GraderError
from graders.fields import JsonFields
from graders.metrics import METRICS
from graders.templates import Template


@dataclass(frozen=True)
class TextSimilarityGrader(Grader):
    type: ClassVar[str] = "text_similarity"
    name: str
    input: Template
    reference: Template
    evaluation_metric: str
    pass_threshold: float | None = None  # evals' field: accepted and echoed, no part in the reward

    @classmethod
    def from_json(cls, fields: JsonFields, default_name: str) -> TextSimilarityGrader:
        fields.only(("type", "name", "input", "reference", "evaluation_metric", "pass_threshold"))
        if fields.obj.get("evaluation_metric") == "cosine":
            param = fields.at("evaluation_metric")
            raise GraderError(
                "unsupported_evaluation_metric", "cosine needs an embedding model: evals only, not RFT", param
            )
        return cls(
            name=fields.string("name", default_name),
            input=Template.parse(fields.string("input"), fields.at("input")),
            reference=Template.parse(fields.string("reference"), fields.at("reference")),
            evaluation_metric=fields.choice("evaluation_metric", METRICS, "invalid_evaluation_metric"),
            pass_threshold=fields.number("pass_threshold") if fields.has("pass_threshold") else None,
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": self.type,
            "name": self.name,
            "input": self.input.source,
            "reference": self.reference.source,
            "evaluation_metric": self.evaluation_metric,
        }
        if self.pass_threshold is not None:
            out["pass_threshold"] = self.pass_threshold
        return out

    def score(self, sample: Sample, item: Item, ctx: GradeContext) -> Scored:
        given, reference = self.input.render(sample, item), self.reference.render(sample, item)
        return Scored(METRICS[self.evaluation_metric](given, reference))
