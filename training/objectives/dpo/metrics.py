"""dpo's metrics, means over a step's (or an evaluation's) pairs: what its step and eval records carry.

rewards_chosen / rewards_rejected: beta (c - c0) and beta (r - r0), the policy's log-prob ratio to the
reference (simpo: beta c / |c| and beta r / |r|, training.objectives.dpo.loss); rewards_accuracy: the
share of pairs whose chosen reward is higher; rewards_margin: chosen less rejected; logps_chosen /
logps_rejected: the completions' summed log-probs (core.run_protocol.PreferenceMetrics).
"""

from __future__ import annotations

from collections.abc import Sequence

# Sums over a micro-batch's pairs, in this order (one vector, one read and one all-reduce per step).
STAT_NAMES = ("rewards_chosen", "rewards_rejected", "rewards_accuracy", "logps_chosen", "logps_rejected")


def metrics(sums: Sequence[float], n_pairs: int) -> dict[str, float]:
    """Means over pairs of STAT_NAMES' sums, plus the reward margin."""
    out = {name: v / n_pairs for name, v in zip(STAT_NAMES, sums, strict=True)}
    out["rewards_margin"] = out["rewards_chosen"] - out["rewards_rejected"]
    return out


def note(m: dict[str, float]) -> str:
    """What the step's and the evaluation's log lines add."""
    return f"reward accuracy {m['rewards_accuracy']:.3f}"
