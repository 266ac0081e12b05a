"""What a chat request asks its answer to be: the tools it offers and how they may be called
(`tools`, `tool_choice`, `parallel_tool_calls`), the JSON it must be (`response_format`), and the grammar
that enforces it (training.decoding.constraint), built on the model's tokenizer in the generation thread.

  - tool_choice "none": the tools are not shown to the model and nothing is parsed (plain text)
  - "auto" (the default with tools): the model may answer or call; calls are read from its output
  - "required", or a named function: the answer is calls (to that function), by grammar
  - response_format json_object / json_schema: the answer is that JSON, compact, by grammar; with tools
    on "auto" the answer is that JSON or calls
A format ftune cannot read (tool_calls.format_of) with tools is a 400 naming the model: its calls could
neither be parsed nor enforced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from core.response_format import ResponseFormatError, check_response_format, schema_of
from inference.errors import invalid
from inference.tool_calls import ToolFormat, format_of, marker_of
from training.chat_template import template_for
from training.decoding.constraint import COMPACT, Grammar, GrammarError

# The tools' JSON: rendered into every prompt, compiled into a forced call's grammar.
MAX_TOOLS_CHARS = 256 * 1024


@dataclass(frozen=True)
class Shape:
    tools: tuple[dict[str, Any], ...] = ()  # offered to the model (none when tool_choice is "none")
    choice: str = "auto"  # "auto", "required", or the one function's name
    parallel: bool = True
    response_format: dict[str, Any] | None = None  # json_object / json_schema (text: None)

    @classmethod
    def of(
        cls,
        tools: list[dict[str, Any]] | None,
        tool_choice: Any,
        parallel: bool | None,
        response_format: dict[str, Any] | None,
    ) -> Shape:
        """The request's fields, checked: 400 naming the field."""
        fmt = response_format if response_format and response_format.get("type") != "text" else None
        if fmt is not None:
            try:
                check_response_format(fmt)
            except ResponseFormatError as e:
                raise invalid(f"{e.field}: {e}", e.field, code="invalid_response_format") from None
        tools = tools or []
        if len(json.dumps(tools)) > MAX_TOOLS_CHARS:  # each call's grammar holds them all
            raise invalid(f"tools: over {MAX_TOOLS_CHARS:,} characters of JSON", "tools", "tools_too_large")
        choice = _choice(tool_choice, tools)
        shown = () if choice == "none" else tuple(tools)
        return cls(shown, "auto" if choice == "none" else choice, parallel is not False, fmt)

    def tool_format(self, tokenizer: Any, model: str) -> ToolFormat | None:
        """How this model writes calls (None without tools); 400 when ftune cannot read its format."""
        if not self.tools:
            return None
        found = format_of(template_for(tokenizer, self.tools))
        if found is None:
            raise invalid(
                f"the chat template of {model!r} writes tool calls in a format ftune cannot read "
                "(it reads Hermes/Qwen <tool_call>, Llama 3 JSON and Mistral [TOOL_CALLS])",
                "tools",
                code="unsupported_tool_format",
            )
        return found

    def grammar(self, tokenizer: Any, fmt: ToolFormat | None) -> Grammar | None:
        """The grammar its answers keep to on this tokenizer, its calls written in `fmt` (tool_format's), or
        None when free."""
        forced = self.choice != "auto"
        if fmt is None or not (forced or self.response_format):
            return None if self.response_format is None else self._json(tokenizer)
        tools = [t for t in self.tools if not forced or self.choice in ("required", t["function"]["name"])]
        rules = fmt.rules(tools, self.parallel, marker_of(fmt, tokenizer))
        if forced:
            return self._lark(tokenizer, "start: calls\n" + rules)
        answer = json.dumps({**_schema(self.response_format), "x-guidance": COMPACT})
        return self._lark(tokenizer, f"start: answer | calls\nanswer: %json {answer}\n{rules}")

    def _json(self, tokenizer: Any) -> Grammar:
        try:
            return Grammar.json_schema(tokenizer, schema_of(self.response_format or {}))
        except GrammarError as e:
            raise invalid(f"response_format: {e}", "response_format", code="invalid_response_format") from e

    def _lark(self, tokenizer: Any, lark: str) -> Grammar:
        try:
            return Grammar.lark(tokenizer, lark)
        except GrammarError as e:
            param = "response_format" if self.response_format else "tools"
            raise invalid(f"cannot enforce this answer: {e}", param, code="invalid_response_format") from e


def _schema(fmt: dict[str, Any] | None) -> dict[str, Any]:
    schema = schema_of(fmt or {})
    return {"type": "object"} if schema is None else schema


def _choice(tool_choice: Any, tools: list[dict[str, Any]]) -> str:
    if tool_choice is None:
        return "auto"
    if tool_choice in ("auto", "none", "required"):
        if tool_choice == "required" and not tools:
            raise invalid("tool_choice required needs tools", "tool_choice", code="invalid_tool_choice")
        return str(tool_choice)
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise invalid(
            'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name"}}',
            "tool_choice",
            code="invalid_tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise invalid(f"tool_choice names {name!r}, which is not in tools", "tool_choice", "unknown_tool")
    return name
