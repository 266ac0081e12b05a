"""A row's messages as the trainer reads them: every role, content and tool call in one shape.

The legacy function-calling form becomes the tools form here (a `function_call` a tool call with a
made-up id, a `function` message a `tool` message answering it, `functions` tools of type function), so
both forms train and render alike; a content that is an array of text parts is joined (core.data.parts).
Only for rows that passed validation (core.data.validate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from core.data.parts import text_of

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class ToolCall:
    """One call of an assistant message: `arguments` is the JSON string of an object, as OpenAI sends it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Message:
    role: Role
    content: str  # "" for an assistant message that only calls tools
    weight: int = 1  # only assistant messages with weight 1 are trained on
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None  # a tool message: the function that answered


# OpenAI's tool definitions ({"type": "function", "function": {...}}), handed to the chat template as given.
Tools = tuple[dict[str, Any], ...]


def row_tools(obj: dict[str, Any]) -> Tools | None:
    """A row's tool definitions as OpenAI's tools; the legacy `functions` become tools of type function."""
    if obj.get("tools"):
        return tuple(obj["tools"])
    if obj.get("functions"):
        return tuple({"type": "function", "function": f} for f in obj["functions"])
    return None


def to_messages(messages: list[dict[str, Any]], trained: bool = False) -> tuple[Message, ...]:
    """Checked messages as Messages, the legacy function-calling form as the tools form: a function_call
    becomes a tool call with a made-up id, and a `function` message a tool message answering it.
    `trained`: an assistant message's weight defaults to 1 (a chat example), else every weight is 0."""
    out: list[Message] = []
    calls: tuple[ToolCall, ...] = ()  # of the last assistant message, which tool messages answer
    for i, m in enumerate(messages):
        role: Role = "tool" if m["role"] == "function" else m["role"]
        weight = int(m.get("weight", 1 if role == "assistant" else 0)) if trained else 0
        content = text_of(m.get("content"))
        if role == "assistant":
            calls = _calls(m, i)
            out.append(Message(role, content, weight, calls))
        elif role == "tool":
            call_id = m.get("tool_call_id") or next(c.id for c in calls if c.name == m["name"])
            name = m.get("name") or next((c.name for c in calls if c.id == call_id), None)
            out.append(Message(role, content, weight, tool_call_id=call_id, name=name))
        else:
            out.append(Message(role, content, weight))
    return tuple(out)


def _calls(m: dict[str, Any], i: int) -> tuple[ToolCall, ...]:
    if m.get("function_call"):
        f = m["function_call"]
        return (ToolCall(f"call_{i}", f["name"], f["arguments"]),)
    return tuple(
        ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
        for c in m.get("tool_calls") or ()
    )


def reply_message(m: dict[str, Any], weight: int = 0) -> Message:
    [message] = to_messages([m])
    return Message(message.role, message.content, weight, message.tool_calls)
