"""Suggestions for a job that does not fit: changes that do fit, each with its own estimate, cheapest first.

Levers, each a category of JobSpec changes ordered from mildest to most aggressive, with a cost that
ranks what the change takes away (speed, quality, hardware, data):
  gradient checkpointing      1   ~1/3 more compute, same result
  smaller micro-batch         1   same effective batch (more accumulation), lower throughput
  fewer prompts per rollout   1.1 grpo: generate() samples fewer prompts at once (rollout_batch_size):
                                  the same distribution, more decoding steps
  8-bit / paged AdamW         2   blockwise 8-bit states; near-identical quality in published results
  QLoRA instead of LoRA       3   4-bit base: slower, small quality cost (full: LoRA 3, QLoRA 4)
  FSDP over N GPUs            4 + log2 N   more hardware (not grpo: its rollouts run on one GPU)
  shorter max_seq_len         5   changes the data the model sees (truncation); grpo: shorter prompts
  fewer generations (grpo)    5.2 smaller groups: noisier group-relative advantages
  shorter completions (grpo)  5.4 answers cut sooner (graded truncated); max_seq_len shrinks with them
A combination is offered only when none of its proper subsets fits (so every suggestion is minimal);
inside one, each lever is relaxed to its mildest setting that still fits.
"""

from __future__ import annotations

import math
from itertools import combinations
from typing import Any

from core.arch import Architecture
from core.spec import JobSpec
from planner.gpus import Gpu
from planner.peak import peak_plan
from planner.types import FTUNE, Runtime, Suggestion

MAX_SUGGESTIONS = 8
MAX_GPUS = 8
MIN_SEQ_LEN = 128
MIN_PROMPT_TOKENS = 64  # grpo: the prompt budget (max_seq_len - max_completion_tokens) is not cut below this
MIN_COMPLETION_TOKENS = 16
PROMPT = "max_prompt_tokens"  # not a JobSpec field: grpo's prompt budget, max_seq_len less the completions

Option = tuple[dict[str, Any], str, float]  # change, description, cost


def _levers(spec: JobSpec) -> list[list[Option]]:
    levers: list[list[Option]] = []
    if not spec.gradient_checkpointing:
        levers.append([({"gradient_checkpointing": True}, "gradient checkpointing", 1.0)])
    mb, ga = spec.micro_batch_size, spec.gradient_accumulation_steps
    eff = mb * ga
    smaller = [d for d in range(mb - 1, 0, -1) if eff % d == 0]
    if smaller:
        levers.append(
            [
                (
                    {"micro_batch_size": d, "gradient_accumulation_steps": eff // d},
                    f"micro-batch {d} x {eff // d} accumulation steps (same effective batch)",
                    1.0 + 0.01 * i,
                )
                for i, d in enumerate(smaller)
            ]
        )
    optims = {"adamw": ["adamw_8bit", "paged_adamw_8bit"], "adamw_8bit": ["paged_adamw_8bit"]}
    if spec.optimizer in optims:
        levers.append(
            [
                ({"optimizer": o}, f"optimizer {o}", 2.0 + 0.5 * i)
                for i, o in enumerate(optims[spec.optimizer])
            ]
        )
    if spec.method == "lora":
        levers.append([({"method": "qlora"}, "QLoRA (4-bit NF4 base) instead of LoRA", 3.0)])
    elif spec.method == "full":
        levers.append(
            [
                ({"method": "lora"}, "LoRA instead of a full fine-tune", 3.0),
                ({"method": "qlora"}, "QLoRA instead of a full fine-tune", 4.0),
            ]
        )
    if spec.rl.enabled:
        return levers + _rl_levers(spec)
    gpus = [g for g in (2, 4, 8) if spec.num_gpus < g <= MAX_GPUS]
    if gpus:
        levers.append([({"num_gpus": g}, f"FSDP over {g} GPUs", 4.0 + math.log2(g)) for g in gpus])
    seqs = []
    s = spec.max_seq_len // 2
    while s >= MIN_SEQ_LEN:
        seqs.append(s)
        s //= 2
    if seqs:
        levers.append([({"max_seq_len": v}, f"max_seq_len {v}", 5.0 + 0.1 * i) for i, v in enumerate(seqs)])
    return levers


def _halvings(value: int, floor: int) -> list[int]:
    out = []
    v = value // 2
    while v >= floor:
        out.append(v)
        v //= 2
    return out


def _rl_levers(spec: JobSpec) -> list[list[Option]]:
    """grpo's own levers: fewer prompts per generate() call, shorter prompts, fewer generations, shorter
    completions. The rollouts' KV cache
    spans max_seq_len, so a shorter completion shortens max_seq_len with it (the prompts keep their
    budget); PROMPT stands for that budget until `_resolve` turns it into max_seq_len."""
    levers: list[list[Option]] = []
    per_call = _halvings(spec.rl.rollout_prompts, 1)
    if per_call:
        levers.append(
            [
                (
                    {"rollout_batch_size": p},
                    f"rollout_batch_size {p} (prompts sampled at once)",
                    1.1 + 0.01 * i,
                )
                for i, p in enumerate(per_call)
            ]
        )
    prompts = _halvings(spec.rl.max_prompt_tokens, MIN_PROMPT_TOKENS)
    if prompts:
        levers.append(
            [({PROMPT: p}, f"prompts of at most {p} tokens", 5.0 + 0.1 * i) for i, p in enumerate(prompts)]
        )
    n = spec.num_generations
    groups = sorted({g for g in [*_halvings(n, 2), 2] if g < n}, reverse=True)
    if groups:
        levers.append(
            [({"num_generations": g}, f"num_generations {g}", 5.2 + 0.1 * i) for i, g in enumerate(groups)]
        )
    completions = _halvings(spec.max_completion_tokens, MIN_COMPLETION_TOKENS)
    if completions:
        levers.append(
            [
                ({"max_completion_tokens": t}, f"completions of at most {t} tokens", 5.4 + 0.1 * i)
                for i, t in enumerate(completions)
            ]
        )
    return levers


def _resolve(spec: JobSpec, change: dict[str, Any]) -> dict[str, Any]:
    """A grpo change of its prompt or completion budget as the JobSpec's fields: max_seq_len is their sum."""
    if PROMPT not in change and "max_completion_tokens" not in change:
        return change
    change = dict(change)
    prompt = change.pop(PROMPT, spec.rl.max_prompt_tokens)
    change["max_seq_len"] = prompt + change.get("max_completion_tokens", spec.max_completion_tokens)
    return change


def suggestions(
    spec: JobSpec, arch: Architecture, gpu: Gpu, runtime: Runtime | None = None
) -> list[Suggestion]:
    """Fitting alternatives to `spec`, cheapest first (see the module docstring)."""
    runtime = runtime or FTUNE

    levers = _levers(spec)
    cache: dict[tuple, tuple[bool, int]] = {}

    def merged(choice: dict[int, int]) -> dict[str, Any]:
        change: dict[str, Any] = {}
        for lever, i in sorted(choice.items()):
            change.update(levers[lever][i][0])
        return _resolve(spec, change)

    def check(choice: dict[int, int]) -> tuple[bool, int]:
        key = tuple(sorted(choice.items()))
        if key not in cache:
            new = spec.model_copy(update=merged(choice))
            plan = peak_plan(new, arch, gpu, None, runtime)
            cache[key] = (plan.fits, plan.total_bytes)
        return cache[key]

    found: list[tuple[float, int, Suggestion]] = []
    fitting: list[set[int]] = []
    for size in range(1, len(levers) + 1):
        for subset in combinations(range(len(levers)), size):
            if any(f <= set(subset) for f in fitting):
                continue
            choice = {lever: len(levers[lever]) - 1 for lever in subset}
            if not check(choice)[0]:
                continue
            for lever in subset:  # relax each lever to its mildest setting that still fits
                for i in range(len(levers[lever])):
                    if check({**choice, lever: i})[0]:
                        choice[lever] = i
                        break
            fitting.append(set(subset))
            fits, total = check(choice)
            cost = sum(levers[lever][i][2] for lever, i in choice.items())
            desc = " + ".join(levers[lever][i][1] for lever, i in sorted(choice.items()))
            found.append(
                (
                    cost,
                    total,
                    Suggestion(change=merged(choice), description=desc, plan_total_bytes=total, fits=fits),
                )
            )
    found.sort(key=lambda t: (t[0], t[1]))
    return [s for _, _, s in found[:MAX_SUGGESTIONS]]
