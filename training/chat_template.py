"""The chat template a conversation is rendered with, the messages it is given, and whether it renders
tools at all.

The template is the tokenizer's own (its "tool_use" one for rows with tools, where it has named
templates), or DEFAULT_CHAT_TEMPLATE, ChatML, for a tokenizer without one. Rows with tools go to it with
transformers' `tools=` argument (training.data.render_chat_pieces); a tool call goes as the Hugging Face
convention has it, `{"type": "function", "function": {"name", "arguments"}}` with the arguments as a
dict, since templates write them with `| tojson` (a string would come out quoted twice). A template
that ignores tools would train the model on calls to tools it was never shown, so rows with tools on
such a model are refused: `tools_problem` renders a probe conversation (a tool, a call, its result) and
says what the template dropped. Admission asks the same of a model's files before a job is queued
(training.template_check).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from core.data.messages import Message, ToolCall

# ChatML, for base models whose tokenizer has no chat template. An assistant turn ends with
# <|im_end|> and the tokenizer's EOS, so the model learns to stop where generation stops.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token or '' }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token or '' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PROBE_NAME, PROBE_ARGUMENT, PROBE_RESULT = "ftune_probe_lookup", "probe-value-7", "probe-result-9"
PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": PROBE_NAME,
            "description": "Look up a record by its key.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
        },
    }
]
PROBE = (
    Message("user", "Which record?", 0),
    Message("assistant", "", 1, (ToolCall("call_probe", PROBE_NAME, json.dumps({"key": PROBE_ARGUMENT})),)),
    Message("tool", PROBE_RESULT, 0, tool_call_id="call_probe", name=PROBE_NAME),
    Message("assistant", "Found it.", 1),
)
_probed: dict[str, str | None] = {}  # template source -> its problem (None: renders tools)


def template_for(tokenizer: Any, tools: Sequence[Any] | None = None) -> str:
    """The template a conversation (with these tools) is rendered with (see the module doc)."""
    if not getattr(tokenizer, "chat_template", None):
        return DEFAULT_CHAT_TEMPLATE
    return str(tokenizer.get_chat_template(None, list(tools) if tools else None))


def template_message(m: Message) -> dict[str, Any]:
    """A message as chat templates read it (see the module doc)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.loads(c.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
        if m.name:
            out["name"] = m.name
    return out


def uses_tools(messages: Sequence[Message], tools: Sequence[Any] | None) -> bool:
    return bool(tools) or any(m.tool_calls or m.role == "tool" for m in messages)


def tools_problem(tokenizer: Any, template: str) -> str | None:
    """What `template` does wrong with tools ("drops the tool calls", ...), or None when it renders the
    definitions, a call's arguments and the call's result. Probed once per template source."""
    if template == DEFAULT_CHAT_TEMPLATE:
        return "has no chat template (ftune's default, ChatML, renders no tools)"
    if template not in _probed:
        _probed[template] = _probe(tokenizer, template)
    return _probed[template]


def _probe(tokenizer: Any, template: str) -> str | None:
    def render(messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return str(
            tokenizer.apply_chat_template(
                [template_message(m) for m in messages],
                chat_template=template,
                tools=PROBE_TOOLS,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        )

    try:
        shown = render(PROBE[:1], True)
        whole = render(PROBE, False)
    except Exception as e:  # a template is code of the model's: any error means it cannot render tools
        return f"fails when given tools ({type(e).__name__}: {str(e)[:200]})"
    dropped = [
        what
        for what, needle, text in (
            ("the tool definitions (tools)", PROBE_NAME, shown),
            ("the assistant's tool calls", PROBE_ARGUMENT, whole),
            ("the tool results", PROBE_RESULT, whole),
        )
        if needle not in text
    ]
    return f"drops {' and '.join(dropped)}" if dropped else None
