"""Each row's next token from its logits: greedy (argmax, as transformers' greedy search) or sampled with
the row's temperature and top_p (transformers' warpers: temperature, then top_p keeping at least one token).

Every sampled row draws from its own torch.Generator (seeded from the request's seed and the choice index,
else at random), so a seeded request gives the same tokens whichever other rows share its batch.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from inference.generation import Sampling


def row_generator(seed: int | None, choice: int) -> torch.Generator:
    """The generator of one choice: `seed + choice` when the request has a seed, else a random seed."""
    return torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed + choice)


def next_tokens(
    logits: torch.Tensor, samplings: Sequence[Sampling], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """logits [rows, vocab] (float32) -> one token per row."""
    chosen = logits.argmax(dim=-1).tolist()
    for row, sampling in enumerate(samplings):
        if not sampling.greedy:
            chosen[row] = _sample(logits[row], sampling, generators[row])
    return chosen


def _sample(scores: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    if sampling.temperature != 1.0:
        scores = scores / sampling.temperature
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - sampling.top_p)
        drop[-1:] = False  # keep at least the most likely token
        scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = scores.softmax(dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())
