"""OpenAI's `response_format`, checked where it is given: a chat completion (inference.structured) and a
reinforcement job's rollouts (JobSpec.response_format). `text` asks nothing; `json_object` any JSON
object; `json_schema` values of its `schema` (`strict` or not: both are enforced). A schema must compile
to a grammar (llguidance, as constrained decoding compiles it: training.decoding.constraint), so a job
that could never sample is refused when it is created, not when it first samples."""

from __future__ import annotations

from typing import Any

MAX_FORMAT_CHARS = 64 * 1024  # a response_format's JSON: a grammar's compile time grows with it
# JSON with no free-running whitespace, as structured outputs write it (a bounded schema, a bounded answer)
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class ResponseFormatError(ValueError):
    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def schema_of(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema to enforce (None: any JSON object)."""
    if response_format.get("type") == "json_object":
        return None
    schema = (response_format.get("json_schema") or {}).get("schema")
    return schema if isinstance(schema, dict) else {"type": "object"}


def check_response_format(fmt: dict[str, Any], where: str = "response_format") -> None:
    """ResponseFormatError naming the field for a malformed response_format or a schema that does not
    compile."""
    import json

    if len(json.dumps(fmt)) > MAX_FORMAT_CHARS:
        raise ResponseFormatError(f"is over {MAX_FORMAT_CHARS:,} characters of JSON", where)
    kind = fmt.get("type")
    if kind not in ("json_object", "json_schema"):
        raise ResponseFormatError("type must be text, json_object or json_schema", f"{where}.type")
    spec = fmt.get("json_schema")
    if kind == "json_schema" and (not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict)):
        raise ResponseFormatError(
            "json_schema must be an object with a `schema` object", f"{where}.json_schema"
        )
    import llguidance

    schema = schema_of(fmt)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema or {"type": "object"}, defaults=COMPACT)  # type: ignore[arg-type]
    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if error:
        raise ResponseFormatError(
            f"the schema cannot be enforced: {messages[0] if messages else 'invalid'}", where
        )
