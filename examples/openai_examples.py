"""Write OpenAI's published fine-tuning example rows as files ftune takes unchanged (deterministic):

- openai_tools.jsonl: function calling as OpenAI's fine-tuning guide shows it: `tools` (function
  definitions with JSON-schema parameters), `parallel_tool_calls`, assistant messages with `tool_calls`
  and no content, `tool` messages answering a call by its `tool_call_id`. The guide's two rows come
  first, as printed; the rest are the same rows for other cities, and two with parallel calls.
- openai_functions.jsonl: the same in the legacy form (`functions`, `function_call`, `function` messages).
- openai_content_parts.jsonl: the guide's "Marv" chat rows with each content an array of text parts.

.venv/bin/python examples/openai_examples.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# The guide's function definition, verbatim.
WEATHER: dict[str, Any] = {
    "name": "get_current_weather",
    "description": "Get the current weather",
    "parameters": {
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "The city and country, eg. San Francisco, USA"},
            "format": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["location", "format"],
    },
}
TOOLS = [{"type": "function", "function": WEATHER}]
CITIES = [
    ("Paris, France", "18", "celsius"), ("Tokyo, Japan", "77", "fahrenheit"),
    ("Oslo, Norway", "4", "celsius"), ("Cairo, Egypt", "91", "fahrenheit"), ("Lima, Peru", "19", "celsius"),
    ("Toronto, Canada", "52", "fahrenheit"), ("Nairobi, Kenya", "24", "celsius"),
    ("Madrid, Spain", "81", "fahrenheit"), ("Sydney, Australia", "22", "celsius"),
]  # fmt: skip


def arguments(location: str, unit: str) -> str:
    return json.dumps({"location": location, "format": unit})


def call(call_id: str, location: str, unit: str) -> dict[str, Any]:
    function = {"name": "get_current_weather", "arguments": arguments(location, unit)}
    return {"id": call_id, "type": "function", "function": function}


def question(location: str, unit: str) -> str:
    city = location.split(",")[0]
    return (
        f"What is the weather in {city}?" if unit == "celsius" else f"How warm is it in {city} in fahrenheit?"
    )


def tool_rows() -> list[dict[str, Any]]:
    sf = "San Francisco, USA"
    rows: list[dict[str, Any]] = [
        {  # the guide's first row: a call, and no parallel calls
            "messages": [
                {"role": "user", "content": "What is the weather in San Francisco?"},
                {"role": "assistant", "tool_calls": [call("call_id", sf, "celsius")]},
            ],
            "parallel_tool_calls": False,
            "tools": TOOLS,
        },
        {  # the guide's second row: the call's result, then the answer
            "messages": [
                {"role": "user", "content": "What is the weather in San Francisco?"},
                {"role": "assistant", "tool_calls": [call("call_id", sf, "celsius")]},
                {"role": "tool", "tool_call_id": "call_id", "content": "21.0"},
                {"role": "assistant", "content": "It is 21 degrees celsius in San Francisco, CA"},
            ],
            "tools": TOOLS,
        },
    ]
    for i, (location, degrees, unit) in enumerate(CITIES):
        ask = {"role": "user", "content": question(location, unit)}
        called = {"role": "assistant", "tool_calls": [call(f"call_{i}", location, unit)]}
        rows.append({"messages": [ask, called], "parallel_tool_calls": False, "tools": TOOLS})
        answer = f"It is {degrees} degrees {unit} in {location.split(',')[0]}."
        result = {"role": "tool", "tool_call_id": f"call_{i}", "content": f"{degrees}.0"}
        rows.append(
            {"messages": [ask, called, result, {"role": "assistant", "content": answer}], "tools": TOOLS}
        )
    for i, ((a, da, _), (b, db, _)) in enumerate([(CITIES[0], CITIES[2]), (CITIES[4], CITIES[8])]):
        both = f"Compare the weather in {a.split(',')[0]} and {b.split(',')[0]}."
        calls = [call(f"call_p{i}a", a, "celsius"), call(f"call_p{i}b", b, "celsius")]
        messages = [
            {"role": "user", "content": both},
            {"role": "assistant", "tool_calls": calls},
            {"role": "tool", "tool_call_id": f"call_p{i}a", "content": f"{da}.0"},
            {"role": "tool", "tool_call_id": f"call_p{i}b", "content": f"{db}.0"},
            {
                "role": "assistant",
                "content": f"{a.split(',')[0]}: {da} degrees; {b.split(',')[0]}: {db} degrees.",
            },
        ]
        rows.append({"messages": messages, "tools": TOOLS})
    return rows


def legacy(row: dict[str, Any]) -> dict[str, Any] | None:
    """A row of tool_rows in the legacy functions form (None for parallel calls, which it cannot say)."""
    messages = []
    for m in row["messages"]:
        if m.get("tool_calls"):
            if len(m["tool_calls"]) > 1:
                return None
            messages.append({"role": "assistant", "function_call": m["tool_calls"][0]["function"]})
        elif m["role"] == "tool":
            messages.append({"role": "function", "name": "get_current_weather", "content": m["content"]})
        else:
            messages.append(m)
    return {"messages": messages, "functions": [WEATHER]}


MARV = "Marv is a factual chatbot that is also sarcastic."
MARV_QA = [  # the guide's three rows first
    ("What's the capital of France?", "Paris, as if everyone doesn't know that already."),
    ("Who wrote 'Romeo and Juliet'?", "Oh, just some guy named William Shakespeare. Ever heard of him?"),
    ("How far is the Moon from Earth?",
     "Around 384,400 kilometers. Give or take a few, like that really matters."),
    ("What's the largest ocean?", "The Pacific. Shocking, I know."),
    ("How many legs does a spider have?", "Eight. Count them if you don't believe me."),
    ("What is the boiling point of water?", "100 degrees celsius at sea level. Groundbreaking stuff."),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci. Maybe you've heard of the guy."),
    ("What's the chemical symbol for gold?", "Au. Not 'Go', sadly."),
    ("How many continents are there?", "Seven, last time anyone bothered to count."),
    ("What planet is closest to the Sun?", "Mercury. It's always in a hurry."),
]  # fmt: skip


def parts(*texts: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t} for t in texts]


def content_part_rows() -> list[dict[str, Any]]:
    rows = []
    for i, (q, a) in enumerate(MARV_QA):
        # Some questions in two parts, as a client that sends a preamble and a question does.
        user = parts(q) if i % 2 == 0 else parts("Quick question: ", q)
        rows.append(
            {
                "messages": [
                    {"role": "system", "content": parts(MARV)},
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": parts(a) if i % 3 else a},
                ]
            }
        )
    return rows


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} examples to {path}")


def main() -> None:
    tools = tool_rows()
    write(HERE / "openai_tools.jsonl", tools)
    write(HERE / "openai_functions.jsonl", [r for row in tools if (r := legacy(row)) is not None])
    write(HERE / "openai_content_parts.jsonl", content_part_rows())


if __name__ == "__main__":
    main()
