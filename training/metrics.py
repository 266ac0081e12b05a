"""metrics.jsonl: one JSON object per line, appended and flushed as training goes.

Records, in order of appearance:
  {"type": "start", "total_steps", "num_examples", "trainable_params", "resumed_from_step"}
  {"type": "step", "step", "total_steps", "epoch", "loss", "lr", "grad_norm", "tokens",
   "tokens_per_s", "elapsed_s", "eta_s", "peak_mem_bytes"}          one per optimizer step
  {"type": "eval", "step", "eval_loss", "eval_token_accuracy", "eval_tokens", "best_eval_loss"}
  {"type": "checkpoint", "step", "path"}                             after the checkpoint is complete
  {"type": "stopped", "step"}                                         after a stop request, last
  {"type": "done", "step", "final_loss", "adapter_dir", "stopped_early", "best_eval_loss", "merged_dir"?}

The file is append-only, also across resumes: a process killed after its last checkpoint may have
written step records that the resumed process repeats. A "start" record with resumed_from_step = k
supersedes every earlier "step", "eval" and "checkpoint" record with step > k; `read_metrics` applies
that rule.
This module does not import torch, so readers can use it cheaply.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

STEPPED = ("step", "eval", "checkpoint")  # records that a resume from an earlier step supersedes


class MetricsWriter:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(_finite(record), separators=(",", ":")) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


class NullWriter(MetricsWriter):
    """What ranks other than 0 write metrics to: nothing."""

    def __init__(self) -> None:
        pass

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def step_record(
    *,
    step: int,
    total_steps: int,
    epoch: float,
    loss: float,
    lr: float,
    grad_norm: float,
    tokens: int,
    step_seconds: float,
    elapsed_s: float,
    peak_mem_bytes: int,
) -> dict[str, Any]:
    """A "step" record. `epoch` is fractional (2.5 = half-way through the third epoch);
    eta_s extrapolates the mean step time so far."""
    eta = elapsed_s / step * (total_steps - step) if step else None
    return {
        "type": "step",
        "step": step,
        "total_steps": total_steps,
        "epoch": round(epoch, 4),
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tokens,
        "tokens_per_s": tokens / step_seconds if step_seconds > 0 else None,
        "elapsed_s": round(elapsed_s, 3),
        "eta_s": round(eta, 1) if eta is not None else None,
        "peak_mem_bytes": peak_mem_bytes,
    }


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file with superseded step records removed (see module doc).
    A torn last line (the writer was killed mid-write) is ignored."""
    records: list[dict[str, Any]] = []
    if not path.is_file():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("type") == "start" and rec.get("resumed_from_step"):
            k = rec["resumed_from_step"]
            records = [r for r in records if not (r.get("type") in STEPPED and r["step"] > k)]
        records.append(rec)
    return records


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN/Infinity; a diverged loss is reported as null rather than breaking readers.
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
