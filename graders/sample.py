"""The `sample` namespace graders see: the model's answer as text, and as JSON when it is a JSON object."""

from __future__ import annotations

import json
from typing import Any

# The sample's fields a template may name (OpenAI's graders guide).
SAMPLE_FIELDS = ("output_text", "output_json", "output_tools", "choices", "output_audio")


def make_sample(
    output_text: str, *, output_tools: list[Any] | None = None, choices: list[Any] | None = None
) -> dict[str, Any]:
    """A sample for `output_text`; output_json is filled only when the text parses as a JSON object, so a
    template naming sample.output_json on any other answer is a sample_parse_error."""
    try:
        parsed = json.loads(output_text)
    except ValueError:
        parsed = None
    return {
        "output_text": output_text,
        "output_json": parsed if isinstance(parsed, dict) else None,
        "output_tools": list(output_tools or []),
        "choices": list(choices or []),
    }
