"""OpenAI's function-calling rows and content parts at upload: valid as OpenAI publishes them, each
malformed tool row refused with its code, line and field, and read back as the trainer sees them."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from core.data.examples import read_examples, read_preferences, read_prompts
from core.data.validate import DatasetValidator, validate_file

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LIMITS: dict[str, Any] = {"max_line_bytes": 1 << 20, "min_examples": 1, "max_problems": 50}

WEATHER: dict[str, Any] = {
    "name": "get_current_weather",
    "description": "Get the current weather",
    "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string"}, "format": {"type": "string", "enum": ["c", "f"]}},
        "required": ["location"],
    },
}
TOOLS = [{"type": "function", "function": WEATHER}]
ARGS = '{"location": "Paris"}'


def call(call_id: str = "call_1", name: str = "get_current_weather", arguments: Any = ARGS) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_row(*calls: dict[str, Any], answered: str | None = "call_1", **extra: Any) -> dict[str, Any]:
    """A user question, an assistant turn of `calls`, a tool message answering `answered`, an answer."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": list(calls or [call()])},
    ]
    if answered is not None:
        messages.append({"role": "tool", "tool_call_id": answered, "content": "18.0"})
        messages.append({"role": "assistant", "content": "It is 18 degrees."})
    return {"messages": messages, "tools": TOOLS, **extra}


def feed(*rows: dict[str, Any]) -> Any:
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    whole = DatasetValidator(**LIMITS)
    whole.feed(data)
    bytewise = DatasetValidator(**LIMITS)
    for i in range(len(data)):
        bytewise.feed(data[i : i + 1])
    assert bytewise.finish() == whole.finish()
    return whole.finish()


@pytest.mark.parametrize(
    ("name", "examples", "with_tools"),
    [("openai_tools", 22, 22), ("openai_functions", 20, 20), ("openai_content_parts", 10, 0)],
)
def test_openais_published_rows_are_valid_as_they_stand(name: str, examples: int, with_tools: int) -> None:
    r = validate_file(EXAMPLES / f"{name}.jsonl", **LIMITS)
    assert r.valid, r.problems[:3]
    assert (r.format, r.kind, r.num_examples, r.duplicates) == ("chat", "sft", examples, 0)
    assert r.stats["with_tools"] == with_tools


def test_the_guides_first_row_reads_back_with_its_tools_and_call() -> None:
    [example, *_] = read_examples(EXAMPLES / "openai_tools.jsonl")
    assert example.tools is not None and example.tools[0]["function"]["name"] == "get_current_weather"
    user, assistant = example.messages
    assert (user.role, user.content, user.weight) == ("user", "What is the weather in San Francisco?", 0)
    assert (assistant.role, assistant.content, assistant.weight) == ("assistant", "", 1)
    [c] = assistant.tool_calls
    assert (c.id, c.name, json.loads(c.arguments)) == (
        "call_id",
        "get_current_weather",
        {"location": "San Francisco, USA", "format": "celsius"},
    )


def test_the_legacy_functions_form_reads_as_the_tools_form() -> None:
    tools = list(read_examples(EXAMPLES / "openai_tools.jsonl"))
    legacy = list(read_examples(EXAMPLES / "openai_functions.jsonl"))
    singles = [e for e in tools if all(len(m.tool_calls) <= 1 for m in e.messages)]
    assert len(legacy) == len(singles) == 20
    for old, new in zip(legacy, singles, strict=True):
        assert old.tools == new.tools
        for a, b in zip(old.messages, new.messages, strict=True):
            assert (a.role, a.content, a.weight) == (b.role, b.content, b.weight)
            assert [(c.name, c.arguments) for c in a.tool_calls] == [
                (c.name, c.arguments) for c in b.tool_calls
            ]
            # a function message answers the call before it: it gets that call's (made-up) id
            assert (a.tool_call_id is None) == (b.tool_call_id is None)
            if a.role == "tool":
                [called] = [m for m in old.messages if m.tool_calls]
                assert (a.tool_call_id, a.name) == (called.tool_calls[0].id, "get_current_weather")


def test_content_parts_are_joined_as_openai_joins_them() -> None:
    examples = list(read_examples(EXAMPLES / "openai_content_parts.jsonl"))
    system, user, assistant = examples[1].messages
    assert system.content == "Marv is a factual chatbot that is also sarcastic."
    assert user.content == "Quick question: Who wrote 'Romeo and Juliet'?"  # back to back, no separator
    assert assistant.content == "Oh, just some guy named William Shakespeare. Ever heard of him?"


def test_tool_rows_are_not_duplicates_of_each_other_when_only_the_tools_differ() -> None:
    other = copy.deepcopy(tool_row())
    other["tools"][0]["function"]["description"] = "Another description"
    assert feed(tool_row(), other, tool_row()).duplicates == 1


IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cheese.jpg"}}
BAD_SCHEMA = {"type": "object", "properties": {"location": {"type": "strng"}}}


def with_tools(tools: list[dict[str, Any]]) -> dict[str, Any]:
    return {**tool_row(), "tools": tools}


USER = {"role": "user", "content": "Hi"}
ANSWER = {"role": "assistant", "content": "Danbo"}
ARGUMENTS, NAME = "messages[1].tool_calls[0].function.arguments", "messages[1].tool_calls[0].function.name"
FNS = [WEATHER]  # the legacy form's definitions
LEGACY_CALL = {"role": "assistant", "function_call": {"name": "get_current_weather", "arguments": ARGS}}


def weather(**function: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {**WEATHER, **function}}]


def chat(*messages: dict[str, Any], **row: Any) -> dict[str, Any]:
    return {"messages": list(messages), **row}


def user(*content: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(content)}


# Each malformed row, the code and the field reported for it.
MALFORMED: list[tuple[dict[str, Any], str, str]] = [
    (tool_row(call(arguments={"location": "Paris"})), "invalid_tool_arguments", ARGUMENTS),
    (tool_row(call(arguments="{location: Paris")), "invalid_tool_arguments", ARGUMENTS),
    (tool_row(call(arguments='["Paris"]')), "invalid_tool_arguments", ARGUMENTS),
    (tool_row(call(name="get_time")), "unknown_tool", NAME),
    ({**tool_row(), "tools": []}, "unknown_tool", NAME),
    ({"messages": tool_row()["messages"]}, "unknown_tool", NAME),
    (tool_row(answered="call_9"), "unknown_tool_call_id", "messages[2].tool_call_id"),
    (with_tools(weather(parameters=BAD_SCHEMA)),
     "invalid_tool_schema", "tools[0].function.parameters.properties.location.type"),
    (with_tools(weather(parameters={"required": "location"})),
     "invalid_tool_schema", "tools[0].function.parameters.required"),
    (with_tools(weather(parameters=[])), "invalid_tool_schema", "tools[0].function.parameters"),
    (with_tools([{"type": "retrieval"}]), "wrong_type", "tools[0].type"),
    (with_tools([{"type": "function", "function": {"description": "no name"}}]),
     "missing_field", "tools[0].function.name"),
    (with_tools(weather(name="has spaces")), "wrong_type", "tools[0].function.name"),
    (tool_row(call(), call("call_2"), parallel_tool_calls=False),
     "parallel_tool_calls_disabled", "messages[1].tool_calls"),
    (tool_row(parallel_tool_calls="no"), "wrong_type", "parallel_tool_calls"),
    ({**tool_row(), "functions": [WEATHER]}, "wrong_type", "functions"),
    (tool_row(call(call_id="")), "empty_content", "messages[1].tool_calls[0].id"),
    (tool_row({"id": "call_1", "type": "function"}), "missing_field", "messages[1].tool_calls[0].function"),
    (chat(USER, {"role": "assistant"}), "missing_field", "messages[1].content"),
    (chat(USER, {"role": "tool", "tool_call_id": "call_1", "content": "x"}, ANSWER, tools=TOOLS),
     "roles_not_alternating", "messages[1].role"),
    (chat(USER, {"role": "assistant", "function_call": {"name": "no", "arguments": ARGS}}, functions=FNS),
     "unknown_tool", "messages[1].function_call.name"),
    (chat(USER, LEGACY_CALL, {"role": "function", "name": "x", "content": "18"}, ANSWER, functions=FNS),
     "unknown_tool_call_id", "messages[2].name"),
    (chat(user({"type": "text", "text": "What cheese?"}, IMAGE), ANSWER),
     "image_url_not_fetched", "messages[0].content[1].image_url.url"),
    (chat(user(), ANSWER), "empty_content", "messages[0].content"),
    (chat(user({"type": "text"}), ANSWER), "missing_field", "messages[0].content[0].text"),
    (chat(user({"type": "text", "text": " "}), ANSWER), "empty_content", "messages[0].content"),
]  # fmt: skip


@pytest.mark.parametrize(("row", "code", "field"), MALFORMED)
def test_each_malformed_row_has_its_code_line_and_field(row: dict[str, Any], code: str, field: str) -> None:
    r = feed(tool_row(), row, tool_row())
    assert [(p.line, p.code, p.field) for p in r.problems] == [(2, code, field)]
    assert r.problems[0].message.startswith(f'line 2: field "{field}" ')
    assert not r.valid and r.num_examples == 2


def test_messages_say_what_is_wrong() -> None:
    def message(row: dict[str, Any]) -> str:
        return str(feed(row).problems[-1].message)  # after the file's too_few_examples

    assert message(tool_row(call(name="get_time"))) == (
        'line 1: field "messages[1].tool_calls[0].function.name" calls "get_time", which is not among the '
        "row's tools (get_current_weather)"
    )
    assert "is not a string of JSON: got object" in message(tool_row(call(arguments={"a": 1})))
    assert 'answers no tool call of messages[1] (its calls: "call_1")' in message(tool_row(answered="call_9"))
    bad = with_tools([{"type": "function", "function": {**WEATHER, "parameters": BAD_SCHEMA}}])
    assert "is not valid JSON Schema: 'strng' is not valid under any of the given schemas" in message(bad)
    image = {"messages": [{"role": "user", "content": [IMAGE]}, {"role": "assistant", "content": "Danbo"}]}
    assert "ftune does not fetch images from URLs: send the image inline as a data: URL" in message(image)


def test_preference_rows_take_tools_and_calls() -> None:
    reply = {"role": "assistant", "tool_calls": [call()]}
    row: dict[str, Any] = {
        "input": {"messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}],
                  "tools": TOOLS},
        "preferred_output": [reply],
        "non_preferred_output": [{"role": "assistant", "content": "I cannot know."}],
    }  # fmt: skip
    r = feed(row)
    assert r.valid and r.kind == "preference" and r.stats["with_tools"] == 1, r.problems
    bad = copy.deepcopy(row)
    bad["preferred_output"][0]["tool_calls"][0]["function"]["name"] = "get_time"
    bad_schema = copy.deepcopy(row)
    bad_schema["input"]["tools"][0]["function"]["parameters"] = BAD_SCHEMA
    r = feed(row, bad, bad_schema)
    assert [(p.line, p.code, p.field) for p in r.problems] == [
        (2, "unknown_tool", "preferred_output[0].tool_calls[0].function.name"),
        (3, "invalid_tool_schema", "input.tools[0].function.parameters.properties.location.type"),
    ]


def test_preference_pairs_read_back_with_tools_and_a_tool_call_reply(tmp_path: Path) -> None:
    row = {
        "input": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS},
        "preferred_output": [{"role": "assistant", "tool_calls": [call()]}],
        "non_preferred_output": [{"role": "assistant", "content": "I cannot know."}],
    }
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(row) + "\n")
    [pair] = read_preferences(path)
    assert pair.tools == tuple(TOOLS)
    assert [c.name for c in pair.chosen.tool_calls] == ["get_current_weather"] and pair.chosen.content == ""


def test_reinforcement_rows_take_tools(tmp_path: Path) -> None:
    row = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, "answer": "18"}
    r = feed(row)
    assert r.valid and r.kind == "reinforcement" and r.stats["with_tools"] == 1
    bad = {**row, "tools": [{"type": "function", "function": {**WEATHER, "parameters": BAD_SCHEMA}}]}
    assert [(p.line, p.code, p.field) for p in feed(row, bad).problems] == [
        (2, "invalid_tool_schema", "tools[0].function.parameters.properties.location.type")
    ]
    path = tmp_path / "rft.jsonl"
    path.write_text(json.dumps(row) + "\n")
    [prompt] = read_prompts(path)
    assert prompt.tools == tuple(TOOLS) and prompt.item["answer"] == "18"


def test_tools_count_in_the_characters_the_planner_estimates_tokens_from() -> None:
    plain = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                          {"role": "assistant", "content": "It is 18 degrees."}]}  # fmt: skip
    with_definitions = {**plain, "tools": TOOLS}
    chars = [feed(r).stats["chars_per_example"]["max"] for r in (plain, with_definitions)]
    assert chars[1] == chars[0] + len(json.dumps(TOOLS))
