"""Why a grader JSON was refused: one exception, a stable code and the dotted path of the offending field."""

from __future__ import annotations

from core.errors import InvalidInput

# The codes parse_grader raises, one per kind of mistake, so clients can branch on them.
GRADER_ERROR_CODES = frozenset(
    {
        "invalid_grader",  # not an object, a missing or unknown field, a value of the wrong type
        "unknown_grader_type",
        "invalid_operation",  # string_check's operation
        "invalid_evaluation_metric",  # text_similarity's metric
        "unsupported_evaluation_metric",  # cosine: OpenAI offers it to evals only, never to fine-tuning
        "invalid_template",  # a {{ }} that is not {{ item.path }} or {{ sample.<field>.path }}
        "grader_too_large",  # more than graders.parse.MAX_GRADER_NODES JSON values
        "template_too_long",  # one template's text over graders.templates.MAX_TEMPLATE_CHARS
        "formula_parse_error",  # multi's calculate_output
        "nested_multi_grader",
        "label_model_outside_multi",  # as OpenAI: a label_model grader only inside a multi grader
        "python_grader_disabled",
        "python_source_too_large",
        "invalid_python_source",  # a syntax error, or no top-level `grade`
    }
)


class GraderError(InvalidInput):
    """A grader JSON that cannot be graded with; `param` names the field from "grader" down, e.g.
    "grader.graders.b.type". An InvalidInput, so the API answers it in its one error shape."""

    def __init__(self, code: str, message: str, param: str) -> None:
        assert code in GRADER_ERROR_CODES, code
        super().__init__(message, code=code, param=param)
        self.param: str = param
