"""Training's run records (core.run_protocol) turned into job progress."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from core.data.token_stats import TokenStats
from core.run_protocol import Record, SamplesRecord, StartRecord, StepRecord, latest_samples

# Fields of a "step" record that are stored on the job row.
PROGRESS_FIELDS = ("step", "total_steps", "epoch", "loss", "tokens_per_s", "eta_s", "peak_mem_bytes")


def progress_values(rec: StepRecord) -> dict[str, Any]:
    """Job-row columns from a step record."""
    values = {k: getattr(rec, k) for k in PROGRESS_FIELDS if getattr(rec, k) is not None}
    if "eta_s" in values:
        values["eta_seconds"] = values.pop("eta_s")
    return values


def token_stats_from_start(rec: StartRecord, spec: dict[str, Any]) -> dict[str, Any] | None:
    """A job's token statistics from training's "start" record (training counts the same way as the
    computation at job creation; it has no micro-batch figures). None if the record has none."""
    stats = rec.token_stats
    if not isinstance(stats, dict) or not stats.get("count"):
        return None
    value = {
        **stats,
        "status": "ready",
        "source": "training_start",
        "dropped": rec.dropped_examples,
        "max_seq_len": spec.get("max_seq_len"),
        "packing": spec.get("packing"),
    }
    try:
        return TokenStats.model_validate(value).model_dump(mode="json", exclude_none=True)
    except ValidationError:
        return None  # a record of another shape must not stop the relay


def samples_document(records: list[Record]) -> dict[str, Any]:
    """The job's samples file (core.storage SAMPLES_FILE): every set in order, one per (step, at);
    GET /jobs/{id}/samples serves it."""
    return {"sets": [r.model_dump(mode="json", exclude={"type"}) for r in latest_samples(records)]}


def samples_message(rec: SamplesRecord) -> str:
    when = "at the end" if rec.at == "end" else "at evaluation"
    n = len(rec.items)
    return f"samples at step {rec.step} ({when}): {n} prompt{'' if n == 1 else 's'}"
