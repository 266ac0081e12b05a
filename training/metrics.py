"""metrics.jsonl: the typed records of core.run_protocol, one per line, appended and fsynced as training
goes; and the speed and ETA a step record reports. What the records are, and how a resume supersedes
earlier ones, is core.run_protocol's (read them with read_records)."""

from __future__ import annotations

import os
from pathlib import Path

from core.run_protocol import Record, encode


class MetricsWriter:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: Record) -> None:
        self._file.write(encode(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())  # a record the worker has read survives a crash of this machine

    def close(self) -> None:
        self._file.close()


class NullWriter(MetricsWriter):
    """What ranks other than 0 write metrics to: nothing."""

    def __init__(self) -> None:
        pass

    def write(self, record: Record) -> None:
        pass

    def close(self) -> None:
        pass


def tokens_per_s(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def eta_s(elapsed_s: float, step: int, total_steps: int) -> float | None:
    """Seconds left, extrapolating the mean step time so far."""
    return round(elapsed_s / step * (total_steps - step), 1) if step else None
