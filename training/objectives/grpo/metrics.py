"""grpo's metrics: what its step and eval records carry (core.run_protocol.RLMetrics, the record's rl)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from core.run_protocol import RLMetrics
from graders import count_errors
from training.rollouts import Completion


def summarize(
    grades: Sequence[Any],
    completions: Sequence[Completion],
    loss_metrics: dict[str, float],
    timing: dict[str, float],
) -> RLMetrics:
    """RLMetrics of graded samples: reward mean and std over those that scored a number, each named
    sub-grader's mean, how many samples hit each grader error, completion lengths, the loss's clip
    ratios and KL (TRL's names, loss.metrics), and the step's timing."""
    rewards = [g.reward for g in grades if not math.isnan(g.reward)]
    mean = sum(rewards) / len(rewards) if rewards else None
    std = None
    if mean is not None and len(rewards) > 1:
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    subs: dict[str, list[float]] = {}
    for g in grades:
        for name, value in g.sub_rewards.items():
            subs.setdefault(name, []).append(value)
    n = max(len(completions), 1)
    return RLMetrics(
        samples=len(grades),
        reward_mean=mean,
        reward_std=std,
        scores={k: sum(v) / len(v) for k, v in subs.items()},
        errors=count_errors(grades),
        completion_tokens_mean=sum(len(c.ids) for c in completions) / n,
        truncated_share=sum(c.truncated for c in completions) / n,
        clip_ratio_low=loss_metrics.get("clip_ratio/low_mean"),
        clip_ratio_high=loss_metrics.get("clip_ratio/high_mean"),
        clip_ratio_region=loss_metrics.get("clip_ratio/region_mean"),
        kl=loss_metrics.get("kl"),
        timing={k: round(v, 4) for k, v in timing.items()},
    )


def note(m: RLMetrics) -> str:
    """What the step's and the evaluation's log lines add."""
    return "reward n/a" if m.reward_mean is None else f"reward {m.reward_mean:.4f}"
