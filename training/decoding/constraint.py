"""Constrained decoding: a row whose every token must keep its text inside a grammar (llguidance).

A `Grammar` is compiled once per request from a JSON schema or a Lark grammar (llguidance's own compilers:
structured outputs, a forced tool call), checked against the model's tokenizer; each row then gets its own
`Constraint`, an llguidance matcher that the decoder asks for the tokens allowed next (the rest of the
row's logits are set to -inf before sampling) and tells each token chosen. When the grammar is complete,
the row's end tokens are allowed; when nothing else may follow, the row ends with one ("stop"), as any
row ends, so a rollout trains on the end token after its JSON too.

llguidance was picked by measurement over xgrammar (bench/grammar_libs.py, the demo tokenizer, 2 cores):
both gave 100 of 100 valid answers; a token's mask applied to the logits costs 35 us with either (a
forward of the demo model takes milliseconds); llguidance installs alone, xgrammar brings triton and a TVM
runtime.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from core.response_format import COMPACT as COMPACT_JSON

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

COMPACT: JsonCompileOptions = COMPACT_JSON  # type: ignore[assignment]

_tokenizers: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot compile (the message says why)."""


def ll_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """llguidance's view of a transformers tokenizer, built once per tokenizer object."""
    with _lock:
        found = _tokenizers.get(tokenizer)
        if found is None:
            found = _tokenizers[tokenizer] = llguidance.hf.from_tokenizer(tokenizer)
        return found


@dataclass(frozen=True)
class Grammar:
    """A grammar compiled once for one tokenizer (a request's, a run's); `constraint()` starts a row on a copy
    of its matcher, so n rows do not compile it n times."""

    tokenizer: llguidance.LLTokenizer
    matcher: llguidance.LLMatcher  # at the grammar's start; never advanced itself

    @classmethod
    def json_schema(cls, tokenizer: Any, schema: dict[str, Any] | None) -> Grammar:
        """Any JSON object (schema None: OpenAI's json_object), else values of `schema`, compact."""
        schema = {"type": "object"} if schema is None else schema
        return cls.checked(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT))

    @classmethod
    def lark(cls, tokenizer: Any, lark: str) -> Grammar:
        return cls.checked(tokenizer, llguidance.LLMatcher.grammar_from_lark(lark))

    @classmethod
    def checked(cls, tokenizer: Any, source: str) -> Grammar:
        ll = ll_tokenizer(tokenizer)
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, ll)
        if error:
            raise GrammarError(messages[0] if messages else "the grammar does not compile")
        return cls(ll, llguidance.LLMatcher(ll, source, log_level=0))

    def constraint(self) -> Constraint:
        return Constraint(self.matcher.deep_copy(), self.tokenizer.eos_tokens)


class Constraint:
    """One row's matcher: `restrict` its next logits in place, then `accept` the token chosen."""

    def __init__(self, matcher: llguidance.LLMatcher, eos: Sequence[int]) -> None:
        self.matcher = matcher
        self.eos = list(eos)  # the tokenizer's, for a row whose own end tokens are off (ignore_eos)

    def restrict(self, logits: torch.Tensor, stops: Collection[int]) -> None:
        """Set the logits [vocab] of every token the grammar forbids next to -inf. The row's end tokens
        are allowed once the grammar is complete (then they are all it allows: the row ends with one, as
        every row does), and in a matcher's error state; never is nothing allowed."""
        vocab = logits.shape[-1]
        allowed = torch.zeros(vocab, dtype=torch.bool)
        if not self.matcher.is_error():
            bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
            n = min(vocab, bits.size)
            allowed[:n] = torch.from_numpy(bits[:n].astype(bool))
        if self.matcher.is_error() or self.matcher.is_accepting():
            allowed[[s for s in stops if s < vocab]] = True
        if not allowed.any():
            allowed[[e for e in self.eos if e < vocab]] = True
        logits.masked_fill_(~allowed.to(logits.device), float("-inf"))

    def accept(self, token: int) -> None:
        self.matcher.consume_token(token)
