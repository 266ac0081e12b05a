"""Examples -> token ids + labels -> padded micro-batches (which examples go together: training.batches).

Labels use -100 for tokens that are not trained on: the inputs (system and user turns, the
instruction, the prompt, the template's markup) unless `train_on_inputs`, and assistant turns with
weight 0 always. Chat and instruction examples are rendered through the tokenizer's chat template, or
DEFAULT_CHAT_TEMPLATE (ChatML: training.chat_template) when the tokenizer has none, one message at a
time: each message's text is the difference between the template rendered up to and including it and
the template rendered up to it, so the pieces concatenate to exactly the full rendering and each token
belongs to one message.
Rows with tools go to the template with its `tools=` argument, their calls and results as templates read
them (training.chat_template); an assistant turn that calls tools is a target like any other, so the loss
covers the calls the model must learn to make.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.data.examples import Example, Message, read_examples
from training.chat_template import (
    template_for,
    template_message,
    tools_problem,
    uses_tools,
)

IGNORE = -100
PAD_MULTIPLE = 8  # padded widths round up to this: tensor-core shapes, fewer distinct shapes
# What a piece of an example is: the inputs (trained only with train_on_inputs), a target, or an
# assistant turn with weight 0 (never trained).
INPUT, TARGET, SKIPPED = "input", "target", "skipped"


class DatasetError(ValueError):
    """The dataset cannot be trained on (empty, no target tokens, does not fit the template)."""


@dataclass(frozen=True)
class Tokenized:
    input_ids: list[int]
    labels: list[int]

    @property
    def length(self) -> int:
        """Tokens the example takes in a micro-batch (training.objectives.dpo.pairs.Pair: both sides')."""
        return len(self.input_ids)

    @property
    def num_targets(self) -> int:
        # The first label never has a predecessor, so it is never a target.
        return sum(1 for x in self.labels[1:] if x != IGNORE)


def tokenize_example(
    example: Example, tokenizer, max_seq_len: int | None, train_on_inputs: bool = False
) -> Tokenized:
    """Token ids and labels of one example, truncated to max_seq_len (None: not truncated)."""
    if example.format in ("chat", "instruction"):
        pieces = render_chat_pieces(example.messages, tokenizer, example.tools)
    else:
        pieces = _raw_pieces(example, tokenizer)
    trained = {TARGET} | ({INPUT} if train_on_inputs else set())
    ids: list[int] = []
    labels: list[int] = []
    for piece_ids, kind in pieces:
        ids.extend(piece_ids)
        labels.extend(piece_ids if kind in trained else [IGNORE] * len(piece_ids))
    return Tokenized(ids[:max_seq_len], labels[:max_seq_len])


def render_chat_pieces(
    messages: Sequence[Message], tokenizer, tools: Sequence[Any] | None = None
) -> list[tuple[list[int], str]]:
    """Split the chat-template rendering into (token ids, kind) pieces, one or two per message.

    An assistant message becomes its generation prompt (an input) and its reply (a target when
    weight is 1), so the targets are exactly what the model must generate after the prompt,
    including the end-of-turn marker. `tools` (OpenAI's tool definitions) go to the template as is.
    """
    template = template_for(tokenizer, tools)
    if uses_tools(messages, tools) and (problem := tools_problem(tokenizer, template)):
        raise DatasetError(f"the base model's chat template cannot render tools: it {problem}")
    dicts = [template_message(m) for m in messages]
    pieces: list[tuple[str, str]] = []
    done = ""
    for i, message in enumerate(messages):
        kind = INPUT
        if message.role == "tool" and i + 1 < len(messages) and messages[i + 1].role == "tool":
            # A run of tool results is one piece: templates that put the run in one turn (Qwen's) close
            # that turn only after its last result, so a prefix ending inside the run renders differently.
            continue
        if message.role == "assistant":
            prompt = _render(tokenizer, template, dicts[:i], add_generation_prompt=True, tools=tools)
            pieces.append((_suffix(prompt, done), INPUT))
            done = prompt
            kind = TARGET if message.weight == 1 else SKIPPED
        full = _render(tokenizer, template, dicts[: i + 1], add_generation_prompt=False, tools=tools)
        pieces.append((_suffix(full, done), kind))
        done = full
    return [(_encode(tokenizer, text), kind) for text, kind in pieces if text]


def _render(
    tokenizer,
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: Sequence[Any] | None = None,
) -> str:
    if not messages and not add_generation_prompt:
        return ""
    extra = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )


def _suffix(text: str, prefix: str) -> str:
    if not text.startswith(prefix):
        # e.g. templates that rewrite earlier turns (drop past reasoning): labels would be wrong.
        raise DatasetError("the model's chat template does not render conversations prefix by prefix")
    return text[len(prefix) :]


def _raw_pieces(example: Example, tokenizer) -> list[tuple[list[int], str]]:
    """prompt_completion: prompt an input, completion + EOS a target. text: everything + EOS a target."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pieces: list[tuple[list[int], str]] = [(bos, INPUT)] if bos else []
    for m in example.messages:
        pieces.append((_encode(tokenizer, m.content), TARGET if m.weight == 1 else INPUT))
    pieces.append((eos, TARGET))
    return pieces


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def load_dataset(
    path: Path,
    tokenizer,
    max_seq_len: int,
    column_mapping: dict[str, str] | None = None,
    over_length: str = "truncate",
    train_on_inputs: bool = False,
) -> tuple[list[Tokenized], int]:
    """Tokenize a validated JSONL file (read with the column mapping it was uploaded with). Returns the
    trainable examples and how many were dropped (see fit_to_length)."""
    whole = tokenize_file(path, tokenizer, column_mapping, train_on_inputs)
    return fit_to_length(whole, max_seq_len, over_length)


def load_for_training(
    path: Path, tokenizer, spec, column_mapping: dict[str, str] | None = None
) -> tuple[list[Tokenized], int, dict[str, int | str]]:
    """A file as training reads it under `spec` (a core.spec.JobSpec): the trainable examples, how many
    were dropped, and the token statistics of the whole examples (before truncation)."""
    whole = tokenize_file(path, tokenizer, column_mapping, spec.train_on_inputs)
    stats = token_stats([len(t.input_ids) for t in whole], spec.max_seq_len, spec.over_length)
    items, dropped = fit_to_length(whole, spec.max_seq_len, spec.over_length)
    return items, dropped, stats


def tokenize_file(
    path: Path, tokenizer, column_mapping: dict[str, str] | None = None, train_on_inputs: bool = False
) -> list[Tokenized]:
    """Every example of a validated JSONL file, whole (not truncated)."""
    try:
        examples = read_examples(path, column_mapping)
        return [tokenize_example(e, tokenizer, None, train_on_inputs) for e in examples]
    except (ValueError, KeyError, TypeError) as e:
        if isinstance(e, DatasetError):
            raise
        raise DatasetError(f"cannot read dataset: {e}") from e


def fit_to_length(
    items: Sequence[Tokenized], max_seq_len: int, over_length: str
) -> tuple[list[Tokenized], int]:
    """Truncate (or, over_length="drop", drop) examples longer than max_seq_len, then drop those left
    with nothing to train on (e.g. the reply was truncated away). Returns (kept, dropped)."""
    if over_length == "drop":
        fitting = [t for t in items if len(t.input_ids) <= max_seq_len]
    else:
        fitting = [Tokenized(t.input_ids[:max_seq_len], t.labels[:max_seq_len]) for t in items]
    kept = [t for t in fitting if t.num_targets > 0]
    if not kept:
        raise DatasetError(
            f"no example has tokens to train on within max_seq_len {max_seq_len} "
            f"(over_length={over_length!r}; is max_seq_len too short?)"
        )
    return kept, len(items) - len(kept)


def token_stats(lengths: Sequence[int], max_seq_len: int, over_length: str) -> dict[str, int | str]:
    """Tokens per example against this model's tokenizer, before truncation, and how many examples
    exceed max_seq_len (they are truncated or dropped, as over_length says)."""
    ordered = sorted(lengths)
    if not ordered:
        return {"count": 0}

    def pct(q: float) -> int:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "count": len(ordered),
        "p50": pct(0.5),
        "p95": pct(0.95),
        "max": ordered[-1],
        "over_max_seq_len": len(ordered) - bisect_right(ordered, max_seq_len),
        "over_length": over_length,
    }


def collate(items: Iterable[Tokenized], pad_id: int, limit: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad to padded_width(longest item, `limit`); padding has label -100. No attention
    mask: in a causal model no real token attends to a later position, so right padding is never seen
    (training.packing). With the loss's targets (scored_targets)."""
    items = list(items)
    width = padded_width(max(len(t.input_ids) for t in items), limit)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE, dtype=torch.long)
    for row, t in enumerate(items):
        n = len(t.input_ids)
        ids[row, :n] = torch.tensor(t.input_ids)
        labels[row, :n] = torch.tensor(t.labels)
    rows = torch.arange(len(items)).repeat_interleave(width)
    return {"input_ids": ids, "labels": labels, **extra_inputs(items, width), **scored_targets(labels, rows)}


def extra_inputs(items: Sequence[Tokenized], width: int | None) -> dict[str, torch.Tensor]:
    """What a micro-batch's examples add to the model's inputs beyond ids and labels, as their own type says
    (a vision-language base's images and 3-D positions: training.vision.VisionTokenized.batch_inputs);
    `width`: the padded row width, None for one packed row."""
    inputs = getattr(type(items[0]), "batch_inputs", None) if items else None
    return inputs(items, width) if inputs is not None else {}


def padded_width(longest: int, limit: int = 0) -> int:
    """The width a padded micro-batch is collated to: its longest row rounded up to PAD_MULTIPLE, but not
    past `limit` (max_seq_len: the planner's worst case stays a bound) unless the row itself is longer."""
    rounded = -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE
    return min(rounded, max(longest, limit)) if limit else rounded


def scored_targets(labels: torch.Tensor, sequence_of: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the loss needs, made once per batch on the host (reading them on a device would wait for it):
    the flat positions (row-major) whose next token is scored, "target_index"; those next tokens,
    "target_labels"; the sequence each belongs to, "target_sequence". `sequence_of`: the sequence of
    each flat position."""
    following = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE).flatten()
    index = (following != IGNORE).nonzero().squeeze(1)
    return {"target_index": index, "target_labels": following[index], "target_sequence": sequence_of[index]}
