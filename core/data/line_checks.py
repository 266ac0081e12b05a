"""Checks of one parsed JSONL line against its format: the first problem found ends the line's checks.

Used by core.data's streaming validator; each problem carries a stable code and the JSON path of the field.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from core.data.examples import Format

ROLES = ("system", "user", "assistant")


class Checked(NamedTuple):
    """What the stats and the duplicate set need from a valid line."""

    chars: int  # characters of content
    messages: int
    key: tuple[Any, ...]  # the used fields: equal keys are duplicate examples
    flag: bool  # chat: starts with a system message; instruction: has a non-empty input


class LineProblem(Exception):
    """One problem that ends the checks of a line (its structure cannot be trusted past it)."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.field = code, message, field


def json_type(value: Any) -> str:
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"


def show(value: Any, limit: int = 40) -> str:
    """A short rendering of a user value for a message: scalars as JSON, containers by type."""
    text = json_type(value) if isinstance(value, (dict, list)) else json.dumps(value)
    return text if len(text) <= limit else text[: limit - 4] + '..."'


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
    value = obj.get(key)
    if value is None:
        if required:
            raise LineProblem("missing_field", "is required", _path(key, at))
        return ""
    if type(value) is not str:
        raise LineProblem("wrong_type", f"must be a string; got {json_type(value)}", _path(key, at))
    if required and (not value or value.isspace()):
        raise LineProblem("empty_content", "must not be empty", _path(key, at))
    if strict:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            msg = "contains an unpaired surrogate escape such as \\ud800 (not valid Unicode)"
            raise LineProblem("invalid_utf8", msg, _path(key, at)) from None
    return value


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


def check_chat(obj: dict[str, Any], strict: bool, prompt: bool = False) -> Checked:
    """Check a chat line; flag: it starts with a system message. `prompt`: a reinforcement line, whose
    messages end in a user turn and need no assistant turn (its other keys are the graders' `item`)."""
    messages = obj["messages"]
    if type(messages) is not list:
        raise LineProblem("wrong_type", f"must be an array; got {json_type(messages)}", "messages")
    if not messages:
        raise LineProblem("empty_content", "must not be empty", "messages")
    first = messages[0]
    system_first = type(first) is dict and first.get("role") == "system"
    chars = 0
    assistant = False
    canon: list[tuple[str, str, int | None]] = []
    for i, m in enumerate(messages):
        if type(m) is not dict:
            raise LineProblem("wrong_type", f"must be an object; got {json_type(m)}", f"messages[{i}]")
        role = _role(m, i, system_first)
        content = _text(m, "content", strict, at=i)
        weight = m.get("weight")
        if weight is not None and (type(weight) is not int or weight not in (0, 1)):
            raise LineProblem("wrong_type", f"must be 0 or 1; got {show(weight)}", _path("weight", i))
        chars += len(content)
        assistant = assistant or role == "assistant"
        canon.append((role, content, weight))
    if prompt:
        return Checked(chars, len(messages), tuple(canon), system_first)
    if not assistant:
        raise LineProblem(
            "no_assistant_turn", "has no assistant message; at least one is required", "messages"
        )
    return Checked(chars, len(messages), tuple(canon), system_first)


def _role(m: dict[str, Any], i: int, system_first: bool) -> str:
    """The role of messages[i]: known, and in order (optional system first, then user/assistant alternate)."""
    role = m.get("role")
    if i == 0 and system_first:
        return "system"
    # The happy path: the role the position asks for.
    expected = "user" if (i - system_first) % 2 == 0 else "assistant"
    if role == expected:
        return role
    if role is None:
        raise LineProblem("missing_field", "is required", _path("role", i))
    if type(role) is not str:
        raise LineProblem("wrong_type", f"must be a string; got {json_type(role)}", _path("role", i))
    if role not in ROLES:
        raise LineProblem(
            "unknown_role", f"must be one of {', '.join(ROLES)}; got {show(role)}", _path("role", i)
        )
    raise LineProblem(
        "roles_not_alternating",
        f'must be "{expected}" (after an optional first system message, roles alternate '
        f"user, assistant, user, ...); got {show(role)}",
        _path("role", i),
    )


# ---- preference pairs (objective dpo): a prompt and two assistant replies

Canon = list[tuple[str, str]]  # (role, content) of checked messages


def check_preference(obj: dict[str, Any], fmt: Format, strict: bool) -> Checked:
    """Check a preference or chosen_rejected line; flag: the prompt is implicit (chosen_rejected without
    a "prompt": the part chosen and rejected share)."""
    if fmt == "preference":
        inp = obj["input"]
        if type(inp) is not dict:
            raise LineProblem("wrong_type", f"must be an object; got {json_type(inp)}", "input")
        if "messages" not in inp:
            raise LineProblem("missing_field", "is required", "input.messages")
        prompt, chars = _conversation(inp["messages"], strict, "input.messages", ends_with="user")
        tools = inp.get("tools")
        if tools is not None and (type(tools) is not list or any(type(t) is not dict for t in tools)):
            raise LineProblem("wrong_type", "must be an array of objects", "input.tools")
        chosen, c_chars = _reply(obj["preferred_output"], strict, "preferred_output")
        rejected, r_chars = _reply(obj["non_preferred_output"], strict, "non_preferred_output")
        return _pair(prompt, chosen, rejected, chars + c_chars + r_chars, "non_preferred_output", False)
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
        prompt, chars = _conversation(prompt_v, strict, "prompt", ends_with="user")
        chosen, c_chars = _reply(chosen_v, strict, "chosen")
        rejected, r_chars = _reply(rejected_v, strict, "rejected")
        return _pair(prompt, chosen, rejected, chars + c_chars + r_chars, "rejected", False)
    # Implicit prompt: two whole conversations that differ only in their last (assistant) message.
    whole_c, c_chars = _conversation(chosen_v, strict, "chosen", ends_with="assistant")
    whole_r, r_chars = _conversation(rejected_v, strict, "rejected", ends_with="assistant")
    shared = 0
    while shared < min(len(whole_c), len(whole_r)) and whole_c[shared] == whole_r[shared]:
        shared += 1
    if whole_c == whole_r:
        raise LineProblem("identical_replies", "chosen and rejected are the same conversation", "rejected")
    if shared == 0 or len(whole_c) != shared + 1 or len(whole_r) != shared + 1:
        raise LineProblem(
            "no_common_prompt",
            "without a prompt, chosen and rejected must be the same conversation up to their last "
            "message, an assistant reply where they differ (the prompt is what they share)",
            "rejected",
        )
    prompt = whole_c[:shared]
    return _pair(prompt, whole_c[shared:], whole_r[shared:], c_chars + r_chars, "rejected", True)


def _conversation(messages: Any, strict: bool, where: str, *, ends_with: str) -> tuple[Canon, int]:
    """Check a list of messages (roles as in chat: an optional system message, then user and assistant
    alternate) ending with `ends_with`; returns them as (role, content) and their characters. Problems
    name fields under `where` (e.g. "input.messages[2].role")."""
    if type(messages) is not list:
        raise LineProblem("wrong_type", f"must be an array; got {json_type(messages)}", where)
    if not messages:
        raise LineProblem("empty_content", "must not be empty", where)
    first = messages[0]
    system_first = type(first) is dict and first.get("role") == "system"
    canon: Canon = []
    chars = 0
    try:
        for i, m in enumerate(messages):
            if type(m) is not dict:
                raise LineProblem("wrong_type", f"must be an object; got {json_type(m)}", f"messages[{i}]")
            role = _role(m, i, system_first)
            content = _text(m, "content", strict, at=i)
            chars += len(content)
            canon.append((role, content))
    except LineProblem as p:
        if p.field and p.field.startswith("messages"):
            p.field = where + p.field[len("messages") :]
        raise
    if canon[-1][0] != ends_with:
        last = f"{where}[{len(canon) - 1}].role"
        raise LineProblem("roles_not_alternating", f'the last message must be "{ends_with}"', last)
    return canon, chars


def _reply(value: Any, strict: bool, where: str) -> tuple[Canon, int]:
    """A reply: an array of exactly one assistant message."""
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
    try:
        content = _text(m, "content", strict, at=0)
    except LineProblem as p:
        p.field = f"{where}[0].content"
        raise
    return [("assistant", content)], len(content)


def _pair(prompt: Canon, chosen: Canon, rejected: Canon, chars: int, where: str, implicit: bool) -> Checked:
    if chosen == rejected:
        raise LineProblem("identical_replies", "the chosen and rejected replies are the same", where)
    return Checked(chars, len(prompt) + 2, ("pair", tuple(prompt), tuple(chosen), tuple(rejected)), implicit)
