"""A model's tool calls in its own format, read from its output and, when a call is required, enforced.

Each family writes calls the way its chat template teaches (the template's own words decide the format):
  - hermes (Qwen, Hermes, the demo model): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    one block per call
  - llama3 (Llama 3.1-3.3 JSON tool calling): `{"name": ..., "parameters": {...}}`, calls separated by `;`,
    optionally after `<|python_tag|>`
  - mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
The output is read with transformers' own streaming response parser (`ResponseParser`, a response_template
per format) into content and calls as they close, so a stream sends a call once it is whole. A tokenizer
that carries its own `response_template` is read with that instead. A call that does not parse ends the
reading: the rest is content, as written (an OpenAI client sees what the model said).

`tool_choice` "required" or a named function is enforced by constrained decoding
(training.decoding.constraint): a Lark grammar of the format's markup around JSON of the tools' own
parameter schemas, so the answer is one or more calls (one when parallel_tool_calls is false).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers.utils.chat_parsing.response_parser import ResponseParser

# JSON written as chat templates' `tojson` writes it, which is what the model was trained on
TOJSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CALL = {"type": "function", "function": {"name": "{content.name}", "arguments": "{content.arguments}"}}


@dataclass(frozen=True)
class ToolFormat:
    name: str
    template: dict[str, Any]  # transformers' response_template
    arguments: str  # the key of a call's arguments in its JSON

    def rules(self, tools: Sequence[dict[str, Any]], parallel: bool, marker: str) -> str:
        """Lark rules (llguidance) whose `calls` is one or more calls to `tools` (one unless `parallel`),
        written as chat templates write them; `marker` names the format's opening markup (a special token
        as `<[id]>`, else a quoted string)."""
        options = [
            {
                "type": "object",
                "properties": {"name": {"const": t["function"]["name"]}, self.arguments: _parameters(t)},
                "required": ["name", self.arguments],
                "additionalProperties": False,
            }
            for t in tools
        ]
        call = json.dumps({"anyOf": options, "x-guidance": TOJSON})
        if self.name == "hermes":
            more = ' ("\\n" call)*' if parallel else ""
            return f'calls: call{more}\ncall: "<tool_call>\\n" %json {call} "\\n</tool_call>"\n'
        if self.name == "llama3":
            more = ' ("; " call)*' if parallel else ""
            return f"calls: call{more}\ncall: %json {call}\n"
        bound = {} if parallel else {"maxItems": 1}
        listed = {"type": "array", "items": {"anyOf": options}, "minItems": 1, **bound, "x-guidance": TOJSON}
        return f"calls: {marker} %json {json.dumps(listed)}\n"


def _reading(start_anchor: str, calls: dict[str, Any]) -> dict[str, Any]:
    """A response_template: content, and the calls as `calls` reads them."""
    return {"start_anchor": start_anchor, "fields": {"content": {"content": "text"}, "tool_calls": calls}}


FORMATS = {
    "hermes": ToolFormat(
        "hermes",
        _reading(
            "<|im_start|>assistant\n",
            {
                "open": "<tool_call>",
                "close": "</tool_call>",
                "content": "json",
                "repeats": True,
                "transform": CALL,
            },
        ),
        "arguments",
    ),
    "llama3": ToolFormat(
        "llama3",
        _reading(
            "<|start_header_id|>assistant<|end_header_id|>",
            {
                "open_pattern": r"(?:<\|python_tag\|>)?(?=\{\s*\"name\")",
                "close_pattern": r"\s*;\s*|$(?![\s\S])",
                "content": "json",
                "repeats": True,
                "transform": {
                    "type": "function",
                    "function": {"name": "{content.name}", "arguments": "{content.parameters}"},
                },
            },
        ),
        "parameters",
    ),
    "mistral": ToolFormat(
        "mistral",
        _reading(
            "[/INST]",
            {
                "open": "[TOOL_CALLS]",
                "content": "json",
                "transform_each": True,
                "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}},
            },
        ),
        "arguments",
    ),
}


def format_of(template: str) -> ToolFormat | None:
    """The format a chat template teaches (from its own markup), or None when ftune does not know it."""
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|start_header_id|>" in template and "parameters" in template:
        return FORMATS["llama3"]
    return None


def marker_of(fmt: ToolFormat, tokenizer: Any) -> str:
    """How a grammar names the format's opening markup: its special token's id when it is one."""
    if fmt.name != "mistral":
        return ""
    token = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    unknown = getattr(tokenizer, "unk_token_id", None)
    return f"<[{token}]>" if isinstance(token, int) and token != unknown else '"[TOOL_CALLS]"'


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # a JSON string, as OpenAI gives it

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


class CallReader:
    """One choice's output read as it streams: `feed` text, get ("content", text) and ("call", Call)
    pieces in order; `finish` at the end. Whitespace around calls is not content."""

    def __init__(self, template: dict[str, Any]) -> None:
        self.parser: ResponseParser | None = ResponseParser(template, prefix="")
        calls = template["fields"]["tool_calls"]
        self.opening = re.compile(calls.get("open_pattern") or re.escape(calls["open"]))
        self.text = ""  # all the output so far
        self.held = ""  # content that is only whitespace so far (shown once more content follows)
        self.calls = 0
        self.spoke = False  # content has been given

    def feed(self, text: str) -> list[tuple[str, Any]]:
        if self.parser is None:
            return [("content", text)] if text else []
        self.text += text
        try:
            return self._pieces(self.parser.feed(text))
        except ValueError:  # a call that does not parse: it and the rest are content
            return self._give_up()

    def finish(self) -> list[tuple[str, Any]]:
        if self.parser is None:
            return []
        try:
            _, events = self.parser.finalize()
            return self._pieces(events)
        except ValueError:
            return self._give_up()

    def _pieces(self, events: list[dict[str, Any]]) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for event in events:
            if event["field"] == "content" and event["type"] == "region_chunk":
                self.held += event["text"]
                if self.held.strip():  # leading whitespace of the whole answer is not content
                    out.append(("content", self.held if self.spoke else self.held.lstrip()))
                    self.held, self.spoke = "", True
            elif event["field"] == "tool_calls" and event["type"] == "region_close":
                values = event["value"] if isinstance(event["value"], list) else [event["value"]]
                out += [("call", _call(value)) for value in values]
                self.calls += len(values)
                self.held = ""
        return out

    def _give_up(self) -> list[tuple[str, Any]]:
        """The text from the opening of the call that failed on, as content; no more parsing."""
        self.parser = None
        starts = [m.start() for m in self.opening.finditer(self.text)]
        rest = self.held + self.text[starts[-1] :] if starts else self.held
        return [("content", rest)] if rest else []


def _call(value: dict[str, Any]) -> Call:
    function = value.get("function") or {}
    arguments = function.get("arguments")
    if not isinstance(function.get("name"), str) or not isinstance(arguments, dict):
        raise ValueError("a tool call needs a name and an object of arguments")
    return Call(f"call_{secrets.token_hex(12)}", function["name"], json.dumps(arguments, ensure_ascii=False))


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    parameters = tool["function"].get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object"}
