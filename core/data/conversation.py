"""The messages of a conversation in an uploaded row: roles in order, contents, weights, tool calls and
the tool messages that answer them.

Roles: an optional system message first, then user and assistant alternate; an assistant message that
calls tools (`tool_calls`, or the legacy `function_call`: core.data.tools) is followed by the `tool`
messages answering its calls (`function` in the legacy form), and those by the assistant's next
message. A tool message names the call it answers, by `tool_call_id` (a `function` message by the
function's `name`), which must be a call of that assistant message: a result that answers no call would
teach the model results out of nowhere. Contents are strings or arrays of text parts (core.data.parts);
an assistant message that calls tools may have none. Used for chat and reinforcement rows and for
preference prompts and replies (core.data.line_checks).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from core.data.images import Fetch
from core.data.messages import ToolCall
from core.data.parts import content_text
from core.data.problems import LineProblem, checked_string, json_type, show
from core.data.tools import ToolSet, check_calls

ROLES = ("system", "user", "assistant", "tool", "function")
# The roles that may follow each state: the previous message's role, "calling" for an assistant message
# that called tools, and "tool" for the answers to them ("function" messages included).
NEXT: dict[str | None, tuple[str, ...]] = {
    None: ("user",),
    "system": ("user",),
    "user": ("assistant",),
    "assistant": ("user",),
    "calling": ("tool",),
    "tool": ("tool", "assistant"),
}


class Conversation(NamedTuple):
    # per message (role, content, weight, calls, the call it answers): equal rows are duplicate examples
    canon: tuple[tuple[Any, ...], ...]
    chars: int  # characters of contents, and of call names and arguments
    assistant: bool  # holds an assistant message
    calls: bool  # holds a tool call


def check_messages(
    messages: Any,
    strict: bool,
    tools: ToolSet | None,
    *,
    where: str = "messages",
    parallel: bool = True,
    after: str | None = None,
    images: bool = False,
    fetch: Fetch | None = None,
) -> Conversation:
    """Check a list of messages; problems name fields under `where` (e.g. "input.messages[2].role").
    `parallel`: an assistant message may call more than one tool (the row's parallel_tool_calls).
    `after`: the role before the first message ("user" for a reply), if any. `images`: image parts are
    allowed (a chat row's, core.data.images; an http(s) one fetched with `fetch`, if given), else refused."""
    if type(messages) is not list:
        raise LineProblem("wrong_type", f"must be an array; got {json_type(messages)}", where)
    if not messages:
        raise LineProblem("empty_content", "must not be empty", where)
    canon: list[tuple[Any, ...]] = []
    chars = 0
    state = after
    calling: tuple[str, tuple[ToolCall, ...]] = ("", ())  # the last assistant message's field and calls
    for i, m in enumerate(messages):
        at = f"{where}[{i}]"
        if type(m) is not dict:
            raise LineProblem("wrong_type", f"must be an object; got {json_type(m)}", at)
        role = _role(m, i, at, state, calling[0])
        weight = m.get("weight")
        if weight is not None and (type(weight) is not int or weight not in (0, 1)):
            raise LineProblem("wrong_type", f"must be 0 or 1; got {show(weight)}", f"{at}.weight")
        calls: tuple[ToolCall, ...] = ()
        answered = None
        if role == "assistant":
            calls, call_chars = check_calls(m, at, tools, strict)
            if len(calls) > 1 and not parallel:
                msg = f"holds {len(calls)} calls, but the row sets parallel_tool_calls to false"
                raise LineProblem("parallel_tool_calls_disabled", msg, f"{at}.tool_calls")
            chars += call_chars
            calling = (at, calls) if calls else calling
            state = "calling" if calls else "assistant"
        elif role in ("tool", "function"):
            answered = _answered(m, role, at, calling, strict)
            if m.get("content") is None:  # a tool's result may be empty, but is never left out
                raise LineProblem("missing_field", "is required", f"{at}.content")
            state = "tool"
        else:
            state = role
        content = content_text(
            m.get("content"),
            f"{at}.content",
            strict,
            required=not calls and state != "tool",
            images=images,
            fetch=fetch,
        )
        chars += len(content)
        canon.append((role, content, weight, calls, answered))
    has_assistant = any(c[0] == "assistant" for c in canon)
    return Conversation(tuple(canon), chars, has_assistant, any(c[3] for c in canon))


def _role(m: dict[str, Any], i: int, at: str, state: str | None, calling: str) -> str:
    """The role of a message: known, and in order after `state` (see NEXT)."""
    role = m.get("role")
    if i == 0 and role == "system":
        return role
    allowed = NEXT[state]
    if ("tool" if role == "function" else role) in allowed:  # the happy path
        return str(role)
    field = f"{at}.role"
    if role is None:
        raise LineProblem("missing_field", "is required", field)
    if type(role) is not str:
        raise LineProblem("wrong_type", f"must be a string; got {json_type(role)}", field)
    if role not in ROLES:
        raise LineProblem("unknown_role", f"must be one of {', '.join(ROLES)}; got {show(role)}", field)
    if state == "calling":
        expected = f'"tool" (the results of the tool calls of {calling})'
    elif state == "tool":
        expected = (
            '"tool" or "assistant" (more results of the tool calls, then the assistant\'s next message)'
        )
    elif role in ("tool", "function"):
        expected = (
            f'"{allowed[0]}" (a "{role}" message answers the tool calls of the assistant message before it)'
        )
    else:
        expected = (
            f'"{allowed[0]}" (after an optional first system message, roles alternate user, assistant, '
            "user, ...)"
        )
    raise LineProblem("roles_not_alternating", f"must be {expected}; got {show(role)}", field)


def _answered(
    m: dict[str, Any], role: str, at: str, calling: tuple[str, tuple[ToolCall, ...]], strict: bool
) -> str:
    """The id of the call a tool message answers (a function message: the function's name)."""
    where, calls = calling
    if role == "tool":
        call_id = checked_string(m.get("tool_call_id"), f"{at}.tool_call_id", strict)
        if all(c.id != call_id for c in calls):
            ids = ", ".join(show(c.id) for c in calls)
            msg = f"answers no tool call of {where} (its calls: {ids})"
            raise LineProblem("unknown_tool_call_id", msg, f"{at}.tool_call_id")
        return call_id
    name = checked_string(m.get("name"), f"{at}.name", strict)
    if all(c.name != name for c in calls):
        names = ", ".join(show(c.name) for c in calls)
        msg = f"names no function that {where} called (it called {names})"
        raise LineProblem("unknown_tool_call_id", msg, f"{at}.name")
    return name
