"""Reading training's metrics.jsonl as it grows, and turning records into job progress."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from core.token_stats import TokenStats

# Fields of a "step" record that are stored on the job row.
PROGRESS_FIELDS = ("step", "total_steps", "epoch", "loss", "tokens_per_s", "eta_s", "peak_mem_bytes")


class MetricsTail:
    """Yields complete new JSON lines of a file that another process appends to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        records = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a torn or foreign line never stops the relay
            if isinstance(rec, dict):
                records.append(rec)
        return records


def progress_values(rec: dict[str, Any]) -> dict[str, Any]:
    """Job-row columns from a step record."""
    values = {k: rec[k] for k in PROGRESS_FIELDS if rec.get(k) is not None}
    if "eta_s" in values:
        values["eta_seconds"] = values.pop("eta_s")
    return values


def token_stats_from_start(rec: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any] | None:
    """A job's token statistics from training's "start" record (training counts the same way as the
    computation at job creation; it has no micro-batch figures). None if the record has none."""
    stats = rec.get("token_stats")
    if not isinstance(stats, dict) or not stats.get("count"):
        return None
    value = {
        **stats,
        "status": "ready",
        "source": "training_start",
        "dropped": rec.get("dropped_examples"),
        "max_seq_len": spec.get("max_seq_len"),
        "packing": spec.get("packing"),
    }
    try:
        return TokenStats.model_validate(value).model_dump(mode="json", exclude_none=True)
    except ValidationError:
        return None  # a record of another shape must not stop the relay
