"""Each row's next token from its logits: greedy (argmax, as transformers' greedy search) or sampled with
the row's temperature and top_p (transformers' warpers: temperature, then top_p keeping at least one token).

Two ways to draw, for two kinds of callers:
  - per row (`per_row`): every sampled row draws from its own torch.Generator on the host (a request's seed
    and choice index, else at random), so a seeded request gives the same tokens whichever other rows
    share its batch (serving);
  - one draw for the batch (`batch`): softmax and torch.multinomial over [rows, vocab] on the model's
    device with torch's generator there, as transformers' generate() samples, so a seeded rollout draws
    the very numbers it drew when generate() made it (training: rollouts, samples; the sequential engine).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None  # new tokens at most (the engine wants it set: inference.engine fills it in)
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # vLLM's sampling extension: generate exactly max_tokens (benchmarks)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def row_generator(seed: int | None, choice: int) -> torch.Generator:
    """The generator of one choice: `seed + choice` when the request has a seed, else a random seed."""
    return torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed + choice)


def warp(scores: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """transformers' TemperatureLogitsWarper then TopPLogitsWarper (min_tokens_to_keep 1) on [..., vocab]."""
    if sampling.temperature != 1.0:
        scores = scores / sampling.temperature
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - sampling.top_p)
        drop[..., -1:] = False  # keep at least the most likely token
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores


def per_row(
    logits: torch.Tensor, samplings: Sequence[Sampling], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """logits [rows, vocab] (float32) -> one token per row, each sampled row with its own generator."""
    chosen = logits.argmax(dim=-1).tolist()
    for row, sampling in enumerate(samplings):
        if not sampling.greedy:
            probs = warp(logits[row], sampling).softmax(dim=-1)
            chosen[row] = int(torch.multinomial(probs.cpu(), 1, generator=generators[row]).item())
    return chosen


def batch(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """logits [rows, vocab] (float32) -> [rows] tokens on their device, every row with one sampling: one
    torch.multinomial call over the batch with the device's generator (transformers' _sample's draw)."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    probs = warp(logits, sampling).softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1).squeeze(1)
