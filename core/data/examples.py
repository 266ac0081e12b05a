"""Normalised training examples: every accepted format becomes a list of messages.

`format` tells the trainer how to render them:
- chat, instruction: through the tokenizer's chat template; loss on assistant messages with weight 1.
- prompt_completion: raw prompt text then completion text; loss on the completion.
- text: raw text; loss on everything.
Preference formats (kind "preference", for objective dpo) become PreferenceExamples: a prompt and two
assistant replies, the chosen and the rejected one (see `to_preference`):
- preference: OpenAI's {"input": {"messages", "tools"?}, "preferred_output": [assistant message],
  "non_preferred_output": [assistant message]}; rendered through the chat template.
- chosen_rejected: TRL's {"prompt"?, "chosen", "rejected"}, each a string (raw text, like
  prompt_completion) or a list of messages (chat template); without "prompt" the prompt is the longest
  common prefix of chosen and rejected (TRL's implicit prompt).
The reinforcement format (kind "reinforcement", for objective grpo) is OpenAI's RFT row: `messages` ending
in a user turn (the prompt the policy answers), and any other keys, which graders read as `item.*`; it
becomes a PromptExample (see `to_prompt`).
Chat, preference and reinforcement rows may carry OpenAI's function calling (core.data.tools checks it):
`tools` (or the legacy `functions`), assistant messages with `tool_calls` (or `function_call`) and `tool`
(or `function`) messages answering them; contents may be arrays of text parts. Their messages are read
by core.data.messages, in one shape whichever form the row used.
Validation (core/data/validate.py) runs at upload; this module only converts lines that already passed it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from core.data.messages import Message, Tools, reply_message, row_tools, to_messages
from core.errors import InvalidInput

Format = Literal[
    "chat", "instruction", "prompt_completion", "text", "preference", "chosen_rejected", "reinforcement"
]
# what a dataset trains: objective sft, dpo (preference pairs) or grpo (reinforcement prompts)
Kind = Literal["sft", "preference", "reinforcement"]
PREFERENCE_FORMATS: tuple[Format, ...] = ("preference", "chosen_rejected")


def kind_of(fmt: str | None) -> Kind | None:
    """The kind of a dataset of this format (None for a file without one)."""
    if fmt is None:
        return None
    if fmt == "reinforcement":
        return "reinforcement"
    return "preference" if fmt in PREFERENCE_FORMATS else "sft"


# The objective that trains each kind of dataset.
KIND_OBJECTIVE = {"sft": "sft", "preference": "dpo", "reinforcement": "grpo"}


@dataclass(frozen=True)
class Example:
    format: Format
    messages: tuple[Message, ...]
    tools: Tools | None = None


@dataclass(frozen=True)
class PreferenceExample:
    """A prompt and two replies to it. `conversational`: rendered through the chat template (the
    prompt's messages, then the reply as an assistant turn); else raw text, the prompt a single user
    message whose content is the text (possibly empty) and each reply its completion text."""

    format: Format
    conversational: bool
    prompt: tuple[Message, ...]
    chosen: Message
    rejected: Message
    tools: Tools | None = None  # OpenAI's input.tools, handed to the chat template


@dataclass(frozen=True)
class PromptExample:
    """A reinforcement row: the prompt the policy answers (messages ending in a user turn) and the whole
    row, which graders read as `item` (OpenAI's RFT passes every key, messages included)."""

    prompt: tuple[Message, ...]
    item: dict[str, Any]
    tools: Tools | None = None


# Every top-level key a format reads; a column mapping may only rename into these.
KNOWN_FIELDS = (
    "messages", "instruction", "input", "output", "prompt", "completion", "text",
    "preferred_output", "non_preferred_output", "chosen", "rejected", "tools", "functions",
    "parallel_tool_calls",
)  # fmt: skip


def check_column_mapping(mapping: dict[str, str] | None) -> dict[str, str]:
    """Validate a user's column mapping ({"their_key": "known_key"}); return it ({} for None)."""
    if not mapping:
        return {}
    if not isinstance(mapping, dict):
        raise InvalidInput("column_mapping must be an object of strings", param="column_mapping")
    seen: dict[str, str] = {}
    for src, dst in mapping.items():
        if not isinstance(src, str) or not src or not isinstance(dst, str):
            raise InvalidInput("column_mapping must map non-empty keys to strings", param="column_mapping")
        if dst not in KNOWN_FIELDS:
            known = ", ".join(KNOWN_FIELDS)
            raise InvalidInput(
                f"column_mapping[{src!r}] must be one of {known}; got {dst!r}", param="column_mapping"
            )
        if dst in seen:
            raise InvalidInput(
                f"column_mapping maps both {seen[dst]!r} and {src!r} to {dst!r}", param="column_mapping"
            )
        seen[dst] = src
    return dict(mapping)


def apply_column_mapping(obj: dict[str, Any], mapping: dict[str, str]) -> dict[str, Any]:
    """Rename keys before detection. A renamed key wins over a key that already had the target name."""
    if not mapping:
        return obj
    out = {k: v for k, v in obj.items() if k not in mapping}
    for src, dst in mapping.items():
        if src in obj:
            out[dst] = obj[src]
    return out


def detect_format(obj: dict[str, Any]) -> Format | None:
    if "preferred_output" in obj and "non_preferred_output" in obj and "input" in obj:
        return "preference"
    if "chosen" in obj and "rejected" in obj:
        return "chosen_rejected"
    if "messages" in obj:
        return "reinforcement" if _ends_with_user(obj["messages"]) else "chat"
    if "instruction" in obj and "output" in obj:
        return "instruction"
    if "prompt" in obj and "completion" in obj:
        return "prompt_completion"
    if "text" in obj:
        return "text"
    return None


def _ends_with_user(messages: Any) -> bool:
    """A conversation that ends in a user turn is a prompt to answer (reinforcement), not an example."""
    return (
        type(messages) is list
        and bool(messages)
        and type(messages[-1]) is dict
        and (messages[-1].get("role") == "user")
    )


def to_prompt(obj: dict[str, Any]) -> PromptExample:
    return PromptExample(to_messages(obj["messages"]), obj, row_tools(obj))


def to_example(obj: dict[str, Any], fmt: Format) -> Example:
    if fmt == "chat":
        return Example(fmt, to_messages(obj["messages"], trained=True), row_tools(obj))
    msgs: tuple[Message, ...]
    if fmt == "instruction":
        prompt = obj["instruction"]
        if obj.get("input"):
            prompt = f"{prompt}\n\n{obj['input']}"
        msgs = (Message("user", prompt, 0), Message("assistant", obj["output"], 1))
    elif fmt == "prompt_completion":
        msgs = (Message("user", obj["prompt"], 0), Message("assistant", obj["completion"], 1))
    else:
        msgs = (Message("assistant", obj["text"], 1),)
    return Example(fmt, msgs)


def to_preference(obj: dict[str, Any], fmt: Format) -> PreferenceExample:
    """A validated preference line as a prompt and two replies (see the module docstring)."""
    if fmt == "preference":
        inp = obj["input"]
        return PreferenceExample(
            fmt,
            True,
            to_messages(inp["messages"]),
            reply_message(obj["preferred_output"][0], 1),
            reply_message(obj["non_preferred_output"][0], 1),
            row_tools(inp),
        )
    prompt, chosen, rejected = split_implicit_prompt(obj)
    if isinstance(chosen, str):
        assert isinstance(rejected, str) and isinstance(prompt, str)
        return PreferenceExample(
            fmt,
            False,
            (Message("user", prompt, 0),),
            Message("assistant", chosen, 1),
            Message("assistant", rejected, 1),
        )
    assert isinstance(prompt, list) and isinstance(rejected, list)
    return PreferenceExample(
        fmt, True, to_messages(prompt), reply_message(chosen[0], 1), reply_message(rejected[0], 1)
    )


def split_implicit_prompt(obj: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a chosen_rejected line. Without a "prompt" key the prompt is the
    longest common prefix of chosen and rejected (characters of strings, messages of lists), as TRL's
    extract_prompt takes it (a space before the split point goes to the completions)."""
    chosen, rejected = obj["chosen"], obj["rejected"]
    if obj.get("prompt") is not None:
        return obj["prompt"], chosen, rejected
    n = min(len(chosen), len(rejected))
    idx = next((i for i in range(n) if chosen[i] != rejected[i]), n)
    if idx < n and idx > 0 and chosen[idx - 1] == " ":
        idx -= 1
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _lines(path: Path, column_mapping: dict[str, str] | None) -> Iterator[tuple[dict[str, Any], Format]]:
    mapping = check_column_mapping(column_mapping)
    with path.open("rb") as f:
        for number, raw in enumerate(f):
            if number == 0:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark, as validation allows
            if not raw.strip():
                continue
            obj = apply_column_mapping(json.loads(raw), mapping)
            fmt = detect_format(obj)
            if fmt is None:
                raise ValueError("dataset line has no known format; was it validated?")
            yield obj, fmt


def is_conversational(path: Path, column_mapping: dict[str, str] | None = None) -> bool:
    """Whether the file's first row is rendered through the chat template (True for an empty file)."""
    for obj, fmt in _lines(path, column_mapping):
        if fmt == "chosen_rejected":
            return to_preference(obj, fmt).conversational
        return fmt in ("chat", "instruction", "preference", "reinforcement")
    return True


def read_examples(path: Path, column_mapping: dict[str, str] | None = None) -> Iterator[Example]:
    """Yield the examples of a validated JSONL dataset file, in file order (blank lines skipped).

    Pass the same column_mapping the file was validated with.
    """
    for obj, fmt in _lines(path, column_mapping):
        if kind_of(fmt) != "sft":
            objective = KIND_OBJECTIVE[kind_of(fmt) or "sft"]
            raise ValueError(f"this is a {fmt} dataset: it trains with objective {objective!r}")
        yield to_example(obj, fmt)


def read_preferences(path: Path, column_mapping: dict[str, str] | None = None) -> Iterator[PreferenceExample]:
    """Yield the pairs of a validated preference dataset file, in file order."""
    for obj, fmt in _lines(path, column_mapping):
        if fmt not in PREFERENCE_FORMATS:
            objective = KIND_OBJECTIVE[kind_of(fmt) or "sft"]
            raise ValueError(
                f"a {fmt!r} dataset has no preference pairs: it trains with objective {objective!r}"
            )
        yield to_preference(obj, fmt)


def read_prompts(path: Path, column_mapping: dict[str, str] | None = None) -> Iterator[PromptExample]:
    """Yield the prompts of a validated reinforcement dataset file, in file order."""
    for obj, fmt in _lines(path, column_mapping):
        if fmt != "reinforcement":
            objective = KIND_OBJECTIVE[kind_of(fmt) or "sft"]
            raise ValueError(
                f"a {fmt!r} dataset has no prompts to answer: it trains with objective {objective!r}"
            )
        yield to_prompt(obj)
