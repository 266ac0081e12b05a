"""Checks of one parsed JSONL line against its format: the first problem found ends the line's checks.

Used by core.data's streaming validator; each problem carries a stable code and the JSON path of the field.
Conversations (roles, contents, tool calls and their results) are core.data.conversation's, tool
definitions core.data.tools'.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from core.data.conversation import Conversation, check_messages
from core.data.examples import Format
from core.data.images import Fetch, count_images
from core.data.problems import LineProblem, checked_string, json_type, show
from core.data.tools import ToolSet, check_tools


class Checked(NamedTuple):
    """What the stats and the duplicate set need from a valid line."""

    chars: int  # characters of content (and of tool definitions, calls and their arguments)
    messages: int
    key: tuple[Any, ...]  # the used fields: equal keys are duplicate examples
    flag: bool  # chat: starts with a system message; instruction: has a non-empty input
    tools: bool = False  # defines tools or calls one
    images: int = 0  # image parts (core.data.images)


def partial_format(obj: dict[str, Any]) -> Format | None:
    """A format a line meant to have but lacks a required key of, for a missing_field message."""
    if "preferred_output" in obj or "non_preferred_output" in obj:
        return "preference"
    if "chosen" in obj or "rejected" in obj:
        return "chosen_rejected"
    if "instruction" in obj or "output" in obj:
        return "instruction"
    if "prompt" in obj or "completion" in obj:
        return "prompt_completion"
    return None


def unknown_format_message(obj: dict[str, Any], reverse: dict[str, str]) -> str:
    keys = ", ".join(show(k) for k in list(obj)[:10]) + (", ..." if len(obj) > 10 else "")
    expected = [
        ("chat", "messages"),
        ("reinforcement", "messages ending in a user turn (+ any keys graders read)"),
        ("instruction", "instruction + output"),
        ("prompt_completion", "prompt + completion"),
        ("text", "text"),
        ("preference", "input + preferred_output + non_preferred_output"),
        ("chosen_rejected", "chosen + rejected (+ prompt)"),
    ]
    alts = "; ".join(f"{name}: {keys_}" for name, keys_ in expected)
    hint = "" if reverse else " (or pass a column_mapping)"
    return f"no known format: expected keys for {alts}{hint}; got keys [{keys}]"


def _path(key: str, at: int | None) -> str:
    """JSON path of a field, built only for a problem: "output" or "messages[2].content"."""
    return key if at is None else f"messages[{at}].{key}"


def _text(
    obj: dict[str, Any], key: str, strict: bool, *, at: int | None = None, required: bool = True
) -> str:
    """The string at obj[key]; raise for a missing, non-string or blank value (null is absent if optional)."""
    return checked_string(obj.get(key), _path(key, at), strict, required=required)


def check_flat(obj: dict[str, Any], fmt: Format, strict: bool) -> Checked:
    """Check an instruction, prompt_completion or text line; flag: an instruction has an input."""
    values: tuple[str, ...]
    has_input = False
    if fmt == "instruction":
        values = (
            _text(obj, "instruction", strict),
            _text(obj, "input", strict, required=False),
            _text(obj, "output", strict),
        )
        has_input = bool(values[1])
    elif fmt == "prompt_completion":
        values = (_text(obj, "prompt", strict), _text(obj, "completion", strict))
    else:
        values = (_text(obj, "text", strict),)
    # Only used fields make an example: extra keys (ids, metadata) do not hide a duplicate.
    return Checked(sum(map(len, values)), 1 if fmt == "text" else 2, (fmt, *values), has_input)


def check_chat(
    obj: dict[str, Any], strict: bool, prompt: bool = False, fetch: Fetch | None = None
) -> Checked:
    """Check a chat line; flag: it starts with a system message. `prompt`: a reinforcement line, whose
    messages end in a user turn and need no assistant turn (its other keys are the graders' `item`).
    Either may define tools (`tools`, or the legacy `functions`) that its assistant messages call.
    `fetch`: its http(s) image URLs are fetched with it and inlined into `obj` (core.data.images)."""
    tools = check_tools(obj, strict)
    parallel = obj.get("parallel_tool_calls", True)
    if type(parallel) is not bool:
        raise LineProblem("wrong_type", f"must be true or false; got {show(parallel)}", "parallel_tool_calls")
    images = count_images(obj["messages"])  # before the images are decoded
    talk = check_messages(obj["messages"], strict, tools, parallel=parallel, images=True, fetch=fetch)
    if not prompt and not talk.assistant:
        raise LineProblem(
            "no_assistant_turn", "has no assistant message; at least one is required", "messages"
        )
    checked = _checked(talk, tools, len(obj["messages"]), obj["messages"][0].get("role") == "system")
    return checked._replace(images=images)


def _checked(talk: Conversation, tools: ToolSet | None, messages: int, flag: bool) -> Checked:
    chars = talk.chars + (tools.chars if tools else 0)
    key = (talk.canon, tools.key if tools else None)
    return Checked(chars, messages, key, flag, tools is not None or talk.calls)


# ---- preference pairs (objective dpo): a prompt and two assistant replies

Canon = tuple[tuple[Any, ...], ...]  # checked messages (core.data.conversation.Conversation.canon)


def check_preference(obj: dict[str, Any], fmt: Format, strict: bool) -> Checked:
    """Check a preference or chosen_rejected line; flag: the prompt is implicit (chosen_rejected without
    a "prompt": the part chosen and rejected share)."""
    if fmt == "preference":
        inp = obj["input"]
        if type(inp) is not dict:
            raise LineProblem("wrong_type", f"must be an object; got {json_type(inp)}", "input")
        if "messages" not in inp:
            raise LineProblem("missing_field", "is required", "input.messages")
        tools = check_tools(inp, strict, "input.")
        prompt = _conversation(inp["messages"], strict, "input.messages", ends_with="user", tools=tools)
        chosen = _reply(obj["preferred_output"], strict, "preferred_output", tools)
        rejected = _reply(obj["non_preferred_output"], strict, "non_preferred_output", tools)
        pair = _pair(prompt, chosen, rejected, "non_preferred_output", False)
        return pair._replace(
            chars=pair.chars + (tools.chars if tools else 0), tools=pair.tools or bool(tools)
        )
    chosen_v, rejected_v, prompt_v = obj["chosen"], obj["rejected"], obj.get("prompt")
    if type(chosen_v) is str:  # raw text, like prompt_completion
        for key, v in (("rejected", rejected_v), ("prompt", prompt_v)):
            if v is not None and type(v) is not str:
                raise LineProblem("wrong_type", f"must be a string, as chosen is; got {json_type(v)}", key)
        c_text, r_text = _text(obj, "chosen", strict), _text(obj, "rejected", strict)
        p_text = _text(obj, "prompt", strict, required=False)  # may be empty, or absent (implicit)
        if c_text == r_text:
            raise LineProblem("identical_replies", "chosen and rejected are the same text", "rejected")
        chars = len(p_text) + len(c_text) + len(r_text)
        return Checked(chars, 3, (fmt, p_text, c_text, r_text), prompt_v is None)
    if type(chosen_v) is not list:
        got = json_type(chosen_v)
        raise LineProblem("wrong_type", f"must be a string or an array of messages; got {got}", "chosen")
    for key, v in (("rejected", rejected_v), ("prompt", prompt_v)):
        if v is not None and type(v) is not list:
            got = json_type(v)
            raise LineProblem("wrong_type", f"must be an array of messages, as chosen is; got {got}", key)
    if prompt_v is not None:
        prompt = _conversation(prompt_v, strict, "prompt", ends_with="user")
        chosen, rejected = _reply(chosen_v, strict, "chosen"), _reply(rejected_v, strict, "rejected")
        return _pair(prompt, chosen, rejected, "rejected", False)
    # Implicit prompt: two whole conversations that differ only in their last (assistant) message.
    whole_c = _conversation(chosen_v, strict, "chosen", ends_with="assistant")
    whole_r = _conversation(rejected_v, strict, "rejected", ends_with="assistant")
    c, r = whole_c.canon, whole_r.canon
    shared = 0
    while shared < min(len(c), len(r)) and c[shared] == r[shared]:
        shared += 1
    if c == r:
        raise LineProblem("identical_replies", "chosen and rejected are the same conversation", "rejected")
    if shared == 0 or len(c) != shared + 1 or len(r) != shared + 1:
        raise LineProblem(
            "no_common_prompt",
            "without a prompt, chosen and rejected must be the same conversation up to their last "
            "message, an assistant reply where they differ (the prompt is what they share)",
            "rejected",
        )
    chars = whole_c.chars + whole_r.chars
    return _pair(whole_c._replace(canon=c[:shared], chars=chars), c[shared:], r[shared:], "rejected", True)


def _conversation(
    messages: Any, strict: bool, where: str, *, ends_with: str, tools: ToolSet | None = None
) -> Conversation:
    """Check a list of messages (as a chat line's) ending with `ends_with`. Problems name fields under
    `where` (e.g. "input.messages[2].role")."""
    talk = check_messages(messages, strict, tools, where=where)
    if talk.canon[-1][0] != ends_with:
        last = f"{where}[{len(talk.canon) - 1}].role"
        raise LineProblem("roles_not_alternating", f'the last message must be "{ends_with}"', last)
    return talk


def _reply(value: Any, strict: bool, where: str, tools: ToolSet | None = None) -> Conversation:
    """A reply: an array of exactly one assistant message (which may call the prompt's tools)."""
    if type(value) is not list:
        got = json_type(value)
        raise LineProblem("wrong_type", f"must be an array holding one assistant message; got {got}", where)
    if len(value) != 1:
        raise LineProblem("wrong_type", f"must hold exactly one assistant message; got {len(value)}", where)
    m = value[0]
    if type(m) is not dict:
        raise LineProblem("wrong_type", f"must be an object; got {json_type(m)}", f"{where}[0]")
    if m.get("role") != "assistant":
        got = show(m.get("role"))
        raise LineProblem("wrong_role", f'must be "assistant" (a reply); got {got}', f"{where}[0].role")
    return check_messages(value, strict, tools, where=where, after="user")


def _pair(
    prompt: Conversation,
    chosen: Conversation | Canon,
    rejected: Conversation | Canon,
    where: str,
    implicit: bool,
) -> Checked:
    """The checked pair; replies as Conversations, or (an implicit prompt) as the canon of their message,
    whose characters the prompt's count holds."""
    c = chosen.canon if isinstance(chosen, Conversation) else chosen
    r = rejected.canon if isinstance(rejected, Conversation) else rejected
    if c == r:
        raise LineProblem("identical_replies", "the chosen and rejected replies are the same", where)
    chars = prompt.chars + sum(x.chars for x in (chosen, rejected) if isinstance(x, Conversation))
    calls = prompt.calls or any(x.calls for x in (chosen, rejected) if isinstance(x, Conversation))
    return Checked(chars, len(prompt.canon) + 2, ("pair", prompt.canon, c, r), implicit, calls)
