"""The token statistics event's wording."""

from __future__ import annotations

from core.data.token_stats import TokenStats, needs_attention, summary

READY = {"status": "ready", "count": 200, "p50": 83, "p95": 160, "max": 240, "max_seq_len": 512}
READY |= {"over_max_seq_len": 0, "over_length": "truncate", "dropped": 0, "packing": True}
READY |= {"micro_batches_per_epoch": 15, "steps_per_epoch": 15, "examples_per_micro_batch": 13.67}
READY |= {"run_epochs": 4}


def test_all_fit() -> None:
    stats = TokenStats.model_validate(READY)
    assert not needs_attention(stats)
    assert summary(stats) == (
        "token statistics: 200 examples, p50 83 / p95 160 / max 240 tokens; 0 exceed max_seq_len 512 "
        "(truncate); packed: ~13.7 examples per micro-batch, 15 steps per epoch; the run makes ~4 epochs"
    )


def test_over_long_and_empty_examples_are_a_warning() -> None:
    stats = TokenStats.model_validate(READY | {"over_max_seq_len": 7, "over_length": "drop", "dropped": 9})
    assert needs_attention(stats)
    text = summary(stats)
    assert text.startswith("warning: token statistics: 200 examples")
    assert (
        "7 exceed max_seq_len 512 and will be dropped; 2 with no tokens to train on will be dropped" in text
    )


def test_padded_and_without_batch_figures() -> None:
    padded = TokenStats.model_validate(READY | {"packing": False, "examples_per_micro_batch": 4})
    assert summary(padded).endswith(
        "padded: ~4 examples per micro-batch, 15 steps per epoch; the run makes ~4 epochs"
    )
    start = {
        k: v
        for k, v in READY.items()
        if "micro_batch" not in k and k not in ("steps_per_epoch", "run_epochs")
    }
    assert summary(TokenStats.model_validate(start)).endswith("0 exceed max_seq_len 512 (truncate)")
