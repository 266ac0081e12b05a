"""dpo's data: preference pairs -> token ids + labels, and the flat view of sequences a micro-batch reads.

A pair is a prompt and two replies, chosen and rejected (core.data.examples.PreferenceExample). Each
side is one sequence, prompt + reply, tokenized exactly as SFT tokenizes an example (training.data):
- conversational pairs through the chat template, message by message (render_chat_pieces): the prompt
  is every piece up to and including the assistant turn's generation prompt, the reply is the
  assistant turn that follows (its end-of-turn marker included), the target an SFT example trains on;
- raw-text pairs as prompt_completion: BOS + the prompt text, then the reply text + EOS.
Labels are -100 on the prompt and the reply's ids on the reply: the loss covers the completion only.

Truncation (max_seq_len counts one side: prompt + its reply), prompt first, then the completions:
  1. a pair whose prompt + longer reply fits is kept whole;
  2. over_length="drop" drops any other pair;
  3. else the prompt keeps its last max(max_seq_len - longer reply, max_seq_len // 2) tokens (those next
     to the reply; at most all of it): a long prompt never takes more than half of the sequence
     from a reply that needs the room;
  4. then both replies keep their first max_seq_len - kept prompt tokens.
A pair left without a target token on either side (an empty reply and no EOS) is dropped.

Which pairs train together is training.batches', on pair indices: a step holds micro x accumulation x
num_gpus pairs (padded: a pair is a row; packed: pairs packed into rows of 2 x max_seq_len tokens), so
the chosen and rejected sides of a pair always share a micro-batch and a rank. `Sequences` is the flat
view the SFT collation and dropout layouts read: sequence 2i is pair i's chosen side, 2i + 1 its rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

from core.data.examples import PreferenceExample, read_preferences
from training.data import (
    IGNORE,
    TARGET,
    DatasetError,
    Tokenized,
    _encode,
    render_chat_pieces,
    token_stats,
)


@dataclass(frozen=True)
class Pair:
    chosen: Tokenized  # prompt + chosen reply; labels on the reply
    rejected: Tokenized  # prompt + rejected reply
    prompt_len: int  # the prompt's tokens (the same on both sides)

    @property
    def length(self) -> int:
        """Tokens of both sides: what a pair takes in a micro-batch."""
        return len(self.chosen.input_ids) + len(self.rejected.input_ids)

    @property
    def num_targets(self) -> int:
        return self.chosen.num_targets + self.rejected.num_targets


@dataclass(frozen=True)
class Whole:
    """A pair's token ids before truncation."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


class Sequences(Sequence[Tokenized]):
    """Pairs as a flat sequence list: 2i is pair i's chosen side, 2i + 1 its rejected side."""

    def __init__(self, pairs: Sequence[Pair]) -> None:
        self.pairs = pairs

    def __len__(self) -> int:
        return 2 * len(self.pairs)

    @overload
    def __getitem__(self, i: int) -> Tokenized: ...
    @overload
    def __getitem__(self, i: slice) -> list[Tokenized]: ...
    def __getitem__(self, i: int | slice) -> Tokenized | list[Tokenized]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        pair = self.pairs[i // 2]
        return pair.rejected if i % 2 else pair.chosen


def sequence_indices(pair_indices: Sequence[int]) -> list[int]:
    """The sequences of these pairs, each pair's chosen side followed by its rejected side."""
    return [s for i in pair_indices for s in (2 * i, 2 * i + 1)]


def tokenize_pair(example: PreferenceExample, tokenizer) -> Whole:
    if not example.conversational:
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        text = example.prompt[0].content if example.prompt else ""
        prompt = bos + (_encode(tokenizer, text) if text else [])
        return Whole(
            prompt,
            _encode(tokenizer, example.chosen.content) + eos,
            _encode(tokenizer, example.rejected.content) + eos,
        )
    prompt_c, chosen = _render_side(example, example.chosen, tokenizer)
    prompt_r, rejected = _render_side(example, example.rejected, tokenizer)
    if prompt_c != prompt_r:  # the template renders the prompt differently by what follows it
        raise DatasetError(
            "the model's chat template renders a pair's prompt differently for its two replies"
        )
    return Whole(prompt_c, chosen, rejected)


def _render_side(example: PreferenceExample, reply, tokenizer) -> tuple[list[int], list[int]]:
    """(prompt ids, reply ids) of prompt + reply, rendered as SFT renders a chat example."""
    pieces = render_chat_pieces((*example.prompt, reply), tokenizer, tools=example.tools)
    if not pieces or pieces[-1][1] != TARGET:
        raise DatasetError("the model's chat template renders an empty assistant reply")
    return [t for ids, _ in pieces[:-1] for t in ids], list(pieces[-1][0])


def fit_pair(whole: Whole, max_seq_len: int, over_length: str) -> Pair | None:
    """The pair as trained under max_seq_len (the module's truncation policy); None: dropped."""
    p, c, r = whole.prompt, whole.chosen, whole.rejected
    longest = max(len(c), len(r))
    if len(p) + longest > max_seq_len:
        if over_length == "drop":
            return None
        keep = min(len(p), max(max_seq_len - longest, max_seq_len // 2))
        p = p[len(p) - keep :]
        c, r = c[: max_seq_len - keep], r[: max_seq_len - keep]
    pair = Pair(_side(p, c), _side(p, r), len(p))
    if pair.chosen.num_targets == 0 or pair.rejected.num_targets == 0:
        return None
    return pair


def _side(prompt: list[int], reply: list[int]) -> Tokenized:
    return Tokenized(prompt + reply, [IGNORE] * len(prompt) + reply)


def tokenize_file(path: Path, tokenizer, column_mapping: dict[str, str] | None = None) -> list[Whole]:
    """Every pair of a validated preference file, whole (not truncated)."""
    try:
        return [tokenize_pair(e, tokenizer) for e in read_preferences(path, column_mapping)]
    except (ValueError, KeyError, TypeError) as e:
        if isinstance(e, DatasetError):
            raise
        raise DatasetError(f"cannot read dataset: {e}") from e


def load_for_training(
    path: Path, tokenizer, spec, column_mapping: dict[str, str] | None = None
) -> tuple[list[Pair], int, dict[str, Any]]:
    """A preference file as training reads it under `spec` (a core.spec.JobSpec): the trainable pairs,
    how many were dropped, and the token statistics of the whole pairs (pair_stats)."""
    whole = tokenize_file(path, tokenizer, column_mapping)
    pairs, dropped = fit_to_length(whole, spec.max_seq_len, spec.over_length)
    return pairs, dropped, pair_stats(whole, spec.max_seq_len, spec.over_length)


def fit_to_length(whole: Sequence[Whole], max_seq_len: int, over_length: str) -> tuple[list[Pair], int]:
    kept = [p for w in whole if (p := fit_pair(w, max_seq_len, over_length)) is not None]
    if not kept:
        raise DatasetError(
            f"no preference pair has tokens to train on within max_seq_len {max_seq_len} "
            f"(over_length={over_length!r}; is max_seq_len too short?)"
        )
    return kept, len(whole) - len(kept)


def pair_stats(whole: Sequence[Whole], max_seq_len: int, over_length: str) -> dict[str, Any]:
    """training.data.token_stats of the pairs' longer side (prompt + longer reply: what max_seq_len
    bounds), so count, p50, p95, max and over_max_seq_len mean what they mean for SFT; plus the prompt
    and reply lengths and how many pairs are truncated (over_length truncate) before training."""
    longer = [len(w.prompt) + max(len(w.chosen), len(w.rejected)) for w in whole]
    stats: dict[str, Any] = dict(token_stats(longer, max_seq_len, over_length))
    if not whole:
        return stats
    stats["kind"] = "preference"
    for name, values in (
        ("prompt", [len(w.prompt) for w in whole]),
        ("completion", [len(x) for w in whole for x in (w.chosen, w.rejected)]),
    ):
        ordered = sorted(values)
        stats[f"{name}_p50"] = ordered[len(ordered) // 2]
        stats[f"{name}_p95"] = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        stats[f"{name}_max"] = ordered[-1]
    over = int(stats.get("over_max_seq_len", 0))
    stats["truncated"] = over if over_length == "truncate" else 0
    return stats
