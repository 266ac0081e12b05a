"""Tool calls read in each family's format (transformers' streaming response parser) and forced by
grammar (llguidance), without a model: the demo tokenizer and the formats' own sample outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from inference.structured import Shape
from inference.tool_calls import FORMATS, CallReader, format_of
from training.chat_template import template_for
from training.decoding.constraint import Grammar

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
SAMPLES = {
    "hermes": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {}}]',
}


def read(fmt: str, text: str, step: int) -> list[tuple[str, object]]:
    reader = CallReader(FORMATS[fmt].template)
    pieces = []
    for at in range(0, len(text), step):
        pieces += reader.feed(text[at : at + step])
    pieces += reader.finish()
    return [(kind, (p.name, json.loads(p.arguments)) if kind == "call" else p) for kind, p in pieces]


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_each_format_reads_its_calls_whole_or_streamed(fmt: str) -> None:
    want = [("call", ("get_weather", {"city": "Paris"})), ("call", ("get_time", {}))]
    for step in (1, 3, 7, 1000):  # streamed a character at a time, in pieces, and whole
        pieces = read(fmt, SAMPLES[fmt], step)
        calls = [p for p in pieces if p[0] == "call"]
        content = "".join(str(p) for kind, p in pieces if kind == "content")
        assert calls == want, (step, pieces)
        assert content.strip() == ("Let me look." if fmt == "hermes" else ""), (step, pieces)


def test_text_without_calls_is_content_and_a_broken_call_is_kept_as_written() -> None:
    assert "".join(str(p) for _, p in read("hermes", "Paris is sunny.", 4)) == "Paris is sunny."
    broken = 'x <tool_call>\n{"name": oops}\n</tool_call> after'
    pieces = read("hermes", broken, 5)
    assert all(kind == "content" for kind, _ in pieces)
    assert "".join(str(p) for _, p in pieces) == broken
    cut = 'Sure <tool_call>\n{"name": "get_weather", "argu'  # max_tokens came first
    assert "".join(str(p) for _, p in read("hermes", cut, 4)) == cut


def test_the_format_is_the_templates_own(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert format_of(template_for(tokenizer, [WEATHER])) is FORMATS["hermes"]  # the demo writes Hermes
    assert format_of("{{ '[TOOL_CALLS]' }}") is FORMATS["mistral"]
    assert format_of("<|start_header_id|>{{ 'parameters' }}") is FORMATS["llama3"]
    assert format_of("{{ messages }}") is None


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_a_forced_call_grammar_takes_the_formats_own_calls_and_nothing_else(
    tiny_model: Path, fmt: str
) -> None:
    """The forced grammar of each format (Lark around the tools' JSON schemas) accepts the format's own
    sample, written as templates write it, and refuses a call to a tool not offered and free text."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rules = FORMATS[fmt].rules([WEATHER, TIME], parallel=True, marker='"[TOOL_CALLS]"')
    grammar = Grammar.lark(tokenizer, "start: calls\n" + rules)
    sample = (
        SAMPLES[fmt].split("\n", 1)[1] if fmt == "hermes" else SAMPLES[fmt].removeprefix("<|python_tag|>")
    )

    def accepts(text: str) -> bool:
        matcher = grammar.matcher.deep_copy()
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    assert accepts(sample)
    assert not accepts(sample.replace("get_time", "rm_rf"))
    assert not accepts("I will not call anything.")


def test_request_checks_name_the_field() -> None:
    from inference.errors import EngineError

    cases = [
        ({"tool_choice": "required"}, "tool_choice", "invalid_tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "unknown_tool"),
        ({"tool_choice": 3}, "tool_choice", "invalid_tool_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_response_format"),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "invalid_response_format",
        ),
    ]
    for fields, param, code in cases:
        with pytest.raises(EngineError) as e:
            Shape.of(
                [WEATHER] if "tool_choice" in fields and fields["tool_choice"] != "required" else [],
                fields.get("tool_choice"),
                None,
                fields.get("response_format"),
            )
        assert (e.value.param, e.value.code) == (param, code)
    with pytest.raises(EngineError) as e:
        Shape.of([WEATHER] * 100 + [{**WEATHER, "pad": "x" * 300000}], None, None, None)
    assert (e.value.param, e.value.code) == ("tools", "tools_too_large")
    none = Shape.of([WEATHER], "none", None, None)
    assert none.tools == () and none.choice == "auto"  # not shown to the model, nothing parsed
