"""Normalised training examples: every accepted format becomes a list of messages.

`format` tells the trainer how to render them:
- chat, instruction: through the tokenizer's chat template; loss on assistant messages with weight 1.
- prompt_completion: raw prompt text then completion text; loss on the completion.
- text: raw text; loss on everything.
Validation (core/data/validate.py) runs at upload; this module only converts lines that already passed it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from core.errors import InvalidInput

Format = Literal["chat", "instruction", "prompt_completion", "text"]
Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True)
class Message:
    role: Role
    content: str
    weight: int = 1  # only assistant messages with weight 1 are trained on


@dataclass(frozen=True)
class Example:
    format: Format
    messages: tuple[Message, ...]


# Every top-level key a format reads; a column mapping may only rename into these.
KNOWN_FIELDS = ("messages", "instruction", "input", "output", "prompt", "completion", "text")


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
    if "messages" in obj:
        return "chat"
    if "instruction" in obj and "output" in obj:
        return "instruction"
    if "prompt" in obj and "completion" in obj:
        return "prompt_completion"
    if "text" in obj:
        return "text"
    return None


def to_example(obj: dict[str, Any], fmt: Format) -> Example:
    if fmt == "chat":
        msgs = tuple(
            Message(m["role"], m["content"], int(m.get("weight", 1 if m["role"] == "assistant" else 0)))
            for m in obj["messages"]
        )
    elif fmt == "instruction":
        prompt = obj["instruction"]
        if obj.get("input"):
            prompt = f"{prompt}\n\n{obj['input']}"
        msgs = (Message("user", prompt, 0), Message("assistant", obj["output"], 1))
    elif fmt == "prompt_completion":
        msgs = (Message("user", obj["prompt"], 0), Message("assistant", obj["completion"], 1))
    else:
        msgs = (Message("assistant", obj["text"], 1),)
    return Example(fmt, msgs)


def read_examples(path: Path, column_mapping: dict[str, str] | None = None) -> Iterator[Example]:
    """Yield the examples of a validated JSONL dataset file, in file order (blank lines skipped).

    Pass the same column_mapping the file was validated with.
    """
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
            yield to_example(obj, fmt)
