"""Reinforcement prompts and their rollouts: a dataset's prompts tokenized, and the policy's sampled answers.

A reinforcement row (core.data.examples.PromptExample) is rendered as training renders the inputs before
a reply (training.samples.chat_prompt_ids: the chat template with its assistant generation prompt), so
the policy answers exactly where a tuned model will. Prompts longer than max_seq_len -
max_completion_tokens are cut from the left (over_length truncate: the question's end is kept) or
dropped (over_length drop).

Rollouts are fixed batches of the decoding engine (training.decoding.engine.decode: transformers'
generate(), step for step, with the KV cache), the prompts left-padded to the longest, under
training.packing.masked_attention (SDPA with the padding mask): `num_generations` samples of each prompt at
the spec's temperature (no top-k or top-p filter, as TRL's defaults), up to max_completion_tokens new
tokens, ending at EOS. The KV cache grows as they do; `cache="static"` (bench/rollouts_decode.py) takes
one of the whole length, with which the decoding step is compiled on CUDA (CUDA graphs), as generate()
compiles it: not timed on a GPU yet, so not the engine's. It needs transformers >= 5.24: before, a static
cache held values in the keys' dtype, and under bf16 autocast with fp32 weights a Llama caches fp32 keys
(rotated in the residual stream's dtype) beside bf16 values (on an H200 with 5.17: index_copy_ refused the
values).

The sampling RNG is forked and seeded from (seed, step, chunk), so a step's samples are a pure function
of the weights and the step: a resumed run samples what an uninterrupted one would have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from core.data.examples import read_prompts
from training.data import IGNORE, DatasetError, Tokenized, token_stats
from training.decoding.constraint import Grammar
from training.decoding.engine import Row, decode
from training.decoding.sampling import Sampling
from training.packing import masked_attention
from training.samples import chat_prompt_ids


@dataclass(frozen=True)
class PromptItem:
    """A prompt to answer: its token ids and its dataset row (the graders' `item`)."""

    input_ids: list[int]
    item: dict[str, Any]

    @property
    def length(self) -> int:
        return len(self.input_ids)

    @property
    def num_targets(self) -> int:
        return 0  # its targets are the completions, sampled during the step


def load_for_training(
    path: Path, tokenizer: Any, spec: Any, column_mapping: dict[str, str] | None = None
) -> tuple[list[PromptItem], int, dict[str, Any]]:
    """A reinforcement file as training reads it: the prompts that fit (spec.rl.max_prompt_tokens), how
    many were dropped, and the token statistics of the whole prompts."""
    try:
        whole = [
            PromptItem(chat_prompt_ids(p.prompt, tokenizer, p.tools), p.item)
            for p in read_prompts(path, column_mapping)
        ]
    except (ValueError, KeyError, TypeError) as e:
        raise DatasetError(f"cannot read dataset: {e}") from e
    limit = spec.rl.max_prompt_tokens
    stats = token_stats([p.length for p in whole], limit, spec.over_length)
    if spec.over_length == "drop":
        kept = [p for p in whole if p.length <= limit]
    else:
        kept = [PromptItem(p.input_ids[-limit:], p.item) for p in whole]
    if not kept:
        raise DatasetError(
            f"no prompt fits max_seq_len {spec.max_seq_len} less max_completion_tokens "
            f"{spec.max_completion_tokens} (over_length={spec.over_length!r})"
        )
    return kept, len(whole) - len(kept), stats


@dataclass(frozen=True)
class Completion:
    ids: list[int]  # the sampled tokens, up to and including EOS when it came
    text: str  # decoded without special tokens: the grader's sample.output_text
    truncated: bool  # stopped by max_completion_tokens, not EOS

    def sequence(self, prompt: Sequence[int]) -> Tokenized:
        """Prompt + completion, the completion's tokens the targets."""
        return Tokenized(list(prompt) + self.ids, [IGNORE] * len(prompt) + self.ids)


def stop_ids(tokenizer: Any, model: Any) -> set[int]:
    """Token ids that end a completion: the tokenizer's EOS, the model's generation config's EOS ids, and
    ChatML's <|im_end|> where the vocabulary has it (the demo template ends a turn with it)."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(x) for x in source)
    im_end = (
        tokenizer.convert_tokens_to_ids("<|im_end|>") if hasattr(tokenizer, "convert_tokens_to_ids") else None
    )
    if isinstance(im_end, int) and im_end != getattr(tokenizer, "unk_token_id", None):
        ids.add(im_end)
    return ids


@torch.no_grad()
def sample(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    *,
    n: int,
    temperature: float,
    max_new_tokens: int,
    seed: Sequence[int],
    device: torch.device,
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
    chunk: int = 8,
    cache: Literal["dynamic", "static"] = "dynamic",
    grammar: Grammar | None = None,
) -> list[list[Completion]]:
    """`n` sampled completions of each prompt (temperature 0: greedy), `chunk` prompts per decoded batch;
    seeded by `seed` (e.g. (spec seed, step)). In eval mode (no dropout), the caller's mode kept. With a
    `grammar` (a reinforcement job's response_format) every completion keeps to it."""
    stops = stop_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops, default=0)
    rng_devices = [device] if device.type == "cuda" else []
    out: list[list[Completion]] = []
    with _sampling(model):
        for k, start in enumerate(range(0, len(prompts), chunk)):
            part = prompts[start : start + chunk]
            with torch.random.fork_rng(devices=rng_devices), autocast():
                torch.manual_seed(_seed(seed, k))
                rows = _generate(model, part, n, temperature, max_new_tokens, stops, pad, cache, grammar)
            for i in range(len(part)):
                out.append([_completion(row, tokenizer) for row in rows[i * n : (i + 1) * n]])
    return out


@contextmanager
def _sampling(model: Any) -> Iterator[None]:
    """Eval mode (no dropout) and masked attention for the block, then the caller's mode again."""
    was_training = model.training
    model.eval()
    try:
        with masked_attention(model):
            yield
    finally:
        model.train(was_training)


def _seed(parts: Sequence[int], k: int) -> int:
    import numpy as np

    return int(np.random.default_rng([*parts, k]).integers(2**62))


def _generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    n: int,
    temperature: float,
    max_new_tokens: int,
    stops: set[int],
    pad: int,
    cache: Literal["dynamic", "static"],
    grammar: Grammar | None = None,
) -> list[Row]:
    """n samples of each prompt decoded together (the prompts repeated n times, left-padded into one
    batch, as generate(num_return_sequences=n) expands them), prompt-major."""
    spec = Sampling(max_tokens=max_new_tokens, temperature=temperature)
    rows = [
        Row(sampling=spec, stops=stops, constraint=grammar.constraint() if grammar else None)
        for _ in prompts
        for _ in range(n)
    ]
    decode(model, [p for p in prompts for _ in range(n)], rows, pad=pad, static_cache=cache == "static")
    return rows


def _completion(row: Row, tokenizer: Any) -> Completion:
    stopped = row.finish_reason == "stop"  # its last token is an end token
    text = tokenizer.decode(row.tokens[:-1] if stopped else row.tokens, skip_special_tokens=True)
    return Completion(list(row.tokens), str(text), truncated=not stopped)
