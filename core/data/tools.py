"""Function calling in an uploaded row, as OpenAI's chat format writes it: the tool definitions and the
calls of assistant messages (the tool messages answering them: core.data.conversation).

Definitions: `tools`, `[{"type": "function", "function": {"name", "description"?, "parameters"?,
"strict"?}}]`, or the legacy `functions`, `[{"name", ...}]`, never both. Each `parameters` must be valid
JSON Schema: checked by the `jsonschema` library against the metaschema its `$schema` names (2020-12
when it names none), because a schema the model is shown but no validator accepts teaches calls that
no client can check. Calls: `tool_calls`, `[{"id", "type": "function", "function": {"name",
"arguments"}}]`, or the legacy `function_call`, `{"name", "arguments"}`; `arguments` is a string of
JSON holding an object (what OpenAI's API sends and its SDKs parse), and `name` one of the row's tools.

A file repeats the same tools on every row, so a definition list is checked once (by its canonical JSON,
in a bounded cache) however many rows carry it.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any, NamedTuple

from core.data.messages import ToolCall
from core.data.problems import LineProblem, checked_string, json_type, show

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name


class ToolSet(NamedTuple):
    """A row's checked definitions: the names calls may use, what makes two rows' tools equal, and the
    characters they add to the row (rendered into the prompt, so the planner's estimate counts them)."""

    names: frozenset[str]
    key: str
    chars: int


def check_tools(container: dict[str, Any], strict: bool, where: str = "") -> ToolSet | None:
    """The checked `tools` or `functions` of a row (or of a preference row's `input`: where="input.");
    None when it has neither."""
    tools, functions = container.get("tools"), container.get("functions")
    if tools is not None and functions is not None:
        raise LineProblem(
            "wrong_type", 'give "tools" or the legacy "functions", not both', f"{where}functions"
        )
    legacy = tools is None
    value = functions if legacy else tools
    if value is None:
        return None
    key = json.dumps(value, sort_keys=True)  # ASCII: lone surrogates are escaped, so it always encodes
    try:
        return _definitions(key, legacy, strict)
    except LineProblem as p:
        p.field = where + (p.field or "")
        raise


@lru_cache(maxsize=256)
def _definitions(key: str, legacy: bool, strict: bool) -> ToolSet:
    root = "functions" if legacy else "tools"
    value = json.loads(key)
    if type(value) is not list:
        raise LineProblem("wrong_type", f"must be an array of tool definitions; got {json_type(value)}", root)
    names = [_definition(d, f"{root}[{i}]", legacy, strict) for i, d in enumerate(value)]
    return ToolSet(frozenset(names), key, len(key))


def _definition(tool: Any, at: str, legacy: bool, strict: bool) -> str:
    """Check one definition; return its function's name."""
    if type(tool) is not dict:
        raise LineProblem("wrong_type", f"must be an object; got {json_type(tool)}", at)
    function: Any = tool
    if not legacy:
        kind = tool.get("type")
        if kind is None:
            raise LineProblem("missing_field", "is required", f"{at}.type")
        if kind != "function":
            raise LineProblem(
                "wrong_type", f'must be "function" (the tools ftune trains); got {show(kind)}', f"{at}.type"
            )
        at, function = f"{at}.function", tool.get("function")
        if function is None:
            raise LineProblem("missing_field", "is required", at)
        if type(function) is not dict:
            raise LineProblem("wrong_type", f"must be an object; got {json_type(function)}", at)
    name = checked_string(function.get("name"), f"{at}.name", strict)
    if not NAME.fullmatch(name):
        raise LineProblem(
            "wrong_type", f'must be 1 to 64 letters, digits, "_" or "-"; got {show(name)}', f"{at}.name"
        )
    checked_string(function.get("description"), f"{at}.description", strict, required=False)
    parameters = function.get("parameters")
    if parameters is not None:
        _check_schema(parameters, f"{at}.parameters")
    return name


def _check_schema(schema: Any, at: str) -> None:
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import Draft202012Validator, validator_for

    if type(schema) is not dict:
        raise LineProblem("invalid_tool_schema", f"must be a JSON Schema object; got {json_type(schema)}", at)
    if type(schema.get("$schema", "")) is not str:
        raise LineProblem("invalid_tool_schema", "must be the URI of a JSON Schema draft", f"{at}.$schema")
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as e:
        where = at + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path)
        raise LineProblem("invalid_tool_schema", f"is not valid JSON Schema: {e.message}", where) from None
    except RecursionError:
        raise LineProblem("invalid_tool_schema", "is nested too deeply", at) from None


def check_calls(
    m: dict[str, Any], at: str, tools: ToolSet | None, strict: bool, any_name: bool = False
) -> tuple[tuple[ToolCall, ...], int]:
    """An assistant message's checked calls (none: ()) and the characters of their names and arguments.
    `any_name`: a call may name a tool not in `tools` (a chat request's history: tools come and go)."""
    calls, legacy = m.get("tool_calls"), m.get("function_call")
    if legacy is not None:
        if calls is not None:
            msg = 'give "tool_calls" or the legacy "function_call", not both'
            raise LineProblem("wrong_type", msg, f"{at}.function_call")
        call = _call(legacy, f"{at}.function_call", tools, strict, "function_call", any_name)
        return (call,), len(call.name) + len(call.arguments)
    if calls is None:
        return (), 0
    if type(calls) is not list:
        raise LineProblem(
            "wrong_type", f"must be an array of tool calls; got {json_type(calls)}", f"{at}.tool_calls"
        )
    if not calls:
        raise LineProblem("empty_content", "must not be empty (leave it out instead)", f"{at}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        where = f"{at}.tool_calls[{j}]"
        if type(c) is not dict:
            raise LineProblem("wrong_type", f"must be an object; got {json_type(c)}", where)
        call_id = checked_string(c.get("id"), f"{where}.id", strict)
        if c.get("type", "function") != "function":
            raise LineProblem("wrong_type", f'must be "function"; got {show(c.get("type"))}', f"{where}.type")
        if c.get("function") is None:
            raise LineProblem("missing_field", "is required", f"{where}.function")
        out.append(_call(c["function"], f"{where}.function", tools, strict, call_id, any_name))
    return tuple(out), sum(len(c.name) + len(c.arguments) for c in out)


def _call(
    function: Any, at: str, tools: ToolSet | None, strict: bool, call_id: str, any_name: bool = False
) -> ToolCall:
    if type(function) is not dict:
        raise LineProblem("wrong_type", f"must be an object; got {json_type(function)}", at)
    name = checked_string(function.get("name"), f"{at}.name", strict)
    if not any_name and (tools is None or name not in tools.names):
        known = ", ".join(sorted(tools.names)) if tools else ""
        where = (
            f"which is not among the row's tools ({known})"
            if known
            else 'but the row defines no tools ("tools")'
        )
        raise LineProblem("unknown_tool", f"calls {show(name)}, {where}", f"{at}.name")
    arguments = function.get("arguments")
    if arguments is None:
        raise LineProblem("missing_field", "is required", f"{at}.arguments")
    if type(arguments) is not str:
        raise LineProblem(
            "invalid_tool_arguments",
            f"is not a string of JSON: got {json_type(arguments)} (OpenAI writes arguments as a string, "
            f'e.g. "{{\\"city\\": \\"Paris\\"}}")',
            f"{at}.arguments",
        )
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as e:
        msg = f"is not valid JSON: {e.msg} (column {e.colno})"
        raise LineProblem("invalid_tool_arguments", msg, f"{at}.arguments") from None
    except (RecursionError, ValueError):
        raise LineProblem("invalid_tool_arguments", "is not valid JSON", f"{at}.arguments") from None
    if type(parsed) is not dict:
        msg = f"must be a JSON object of the call's arguments; got {json_type(parsed)}"
        raise LineProblem("invalid_tool_arguments", msg, f"{at}.arguments")
    checked_string(arguments, f"{at}.arguments", strict, required=False)  # lone surrogates
    return ToolCall(call_id, name, arguments)
