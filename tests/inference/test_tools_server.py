"""Tools and structured outputs through a real engine process, driven by the official openai SDK: JSON
answers that keep to their schema, forced and free tool calls in OpenAI's shapes, streamed the same, the
SDK's function-calling loop, and bad input as 400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.inference.conftest import BASE
from tests.inference.test_server import GENERATION_S, KEY, running_engine
from training.demo import TINY, build_demo_model

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PICK = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["color", "n"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with room for a tool preamble and a call: 2,048 positions, not 512."""
    return build_demo_model(
        tmp_path_factory.mktemp("models"), name=BASE, size=replace(TINY, max_position_embeddings=2048)
    )


@pytest.fixture(scope="module")
def client(long_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with running_engine(
        long_tiny, tmp_path_factory.mktemp("engine"), GENERATION_S, flags=("--max-waiting", "32")
    ) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_json_schema_answers_of_the_random_model_all_validate(client: openai.OpenAI) -> None:
    """Issue 40's bar: 100 of 100 answers sampled at temperature 1 parse and validate against a bounded
    schema within 64 tokens, written as compact JSON."""
    form = {"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK, "strict": True}}

    def ask(seed: int) -> list[Any]:
        reply = client.chat.completions.create(
            model=BASE, messages=ASK, response_format=form, temperature=1, max_tokens=64, n=10, seed=seed
        )
        return list(reply.choices)

    with ThreadPoolExecutor(4) as pool:
        choices = [c for batch in pool.map(ask, range(10)) for c in batch]
    assert len(choices) == 100
    for choice in choices:
        text = choice.message.content
        value = json.loads(text)
        jsonschema.validate(value, PICK)
        assert text == json.dumps(value, separators=(",", ":")), text  # compact: no free-running whitespace
        assert choice.finish_reason == "stop"
    assert len({c.message.content for c in choices}) > 5  # sampled, not one forced answer


def test_json_object_is_an_object_and_a_schema_llguidance_refuses_is_a_400(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=BASE, messages=ASK, response_format={"type": "json_object"}, temperature=0, max_tokens=64
    )
    text = reply.choices[0].message.content or ""
    assert text.startswith("{")  # an object from its first token (it may run out of tokens before closing)
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "two"}},
    }
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=BASE, messages=ASK, response_format=bad, max_tokens=8)
    assert e.value.body["param"] == "response_format" and e.value.body["code"] == "invalid_response_format"


def calls_of(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_required_and_named_tool_choice_give_calls_in_openais_shape(client: openai.OpenAI) -> None:
    for choice, names in (
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ):
        reply = client.chat.completions.create(
            model=BASE,
            messages=ASK,
            tools=[WEATHER, CLOCK],
            tool_choice=choice,
            parallel_tool_calls=False,
            temperature=1,
            seed=3,
        )
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls", reply
        [(name, arguments)] = calls_of(message)  # one call: parallel_tool_calls false
        assert name in names
        tool = WEATHER if name == "get_weather" else CLOCK
        jsonschema.validate(arguments, tool["function"]["parameters"])
        assert message.tool_calls[0].id.startswith("call_") and message.tool_calls[0].type == "function"


def test_a_streamed_call_is_the_same_call(client: openai.OpenAI) -> None:
    ask = {
        "model": BASE,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 1,
        "seed": 11,
    }
    whole = client.chat.completions.create(**ask).choices[0]
    with client.chat.completions.stream(**ask) as stream:  # the SDK's own accumulation of the deltas
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert calls_of(streamed.message) == calls_of(whole.message) != []
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"


def test_the_sdks_function_calling_loop_runs_unchanged(client: openai.OpenAI) -> None:
    """Call, run the tool, send the `tool` message, get the answer: OpenAI's guide, as written."""
    messages: list[Any] = list(ASK)
    first = client.chat.completions.create(
        model=BASE, messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=40, seed=5
    )
    message = first.choices[0].message
    messages.append(message)  # the SDK's message object, sent back as is
    for call in message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        messages.append(
            {
                "role": "tool",
                "tool_call_id": call.id,
                "content": json.dumps({"city": arguments["city"], "sky": "clear"}),
            }
        )
    answer = client.chat.completions.create(
        model=BASE, messages=messages, tools=[WEATHER], max_tokens=16, seed=5
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert (
        answer.usage is not None and answer.usage.prompt_tokens > first.usage.prompt_tokens
    )  # the result was read
    plain = client.chat.completions.create(
        model=BASE, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=16
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason != "tool_calls"


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
            "tools[0].function.parameters.type",
            "invalid_tool_schema",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "rm"}}},
            "tool_choice",
            "unknown_tool",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
                ]
            },
            "messages[0].content[0]",
            "unsupported_content",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": "{bad"},
                            }
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
            "invalid_tool_arguments",
        ),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id", "missing_field"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(
    client: openai.OpenAI, fields: dict[str, Any], param: str, code: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": BASE, "messages": ASK, "max_tokens": 4, **fields})
    assert (e.value.body["param"], e.value.body["code"]) == (param, code), e.value.body
