"""Running summaries of an upload: its sha256 (hashed beside parsing), constant-memory example stats,
and the exact duplicate count (8 bytes per example, spilled to disk past a bound)."""

from __future__ import annotations

import hashlib
import random
import tempfile
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from core.data.examples import Format

# Percentiles come from a fixed-size, fixed-seed reservoir: exact up to this many examples.
RESERVOIR_SIZE = 10_000


class StreamSha256:
    """sha256 of a byte stream that overlaps hashing with parsing.

    hashlib releases the GIL on large buffers, so big chunks are hashed on one helper thread while the
    caller parses them. At most one chunk is in flight, so memory stays bounded.
    """

    THREAD_MIN_BYTES = 1 << 16

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self._pool: ThreadPoolExecutor | None = None
        self._busy: Future[None] | None = None

    def update(self, chunk: bytes) -> None:
        self._wait()
        if len(chunk) < self.THREAD_MIN_BYTES:
            self._hash.update(chunk)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftune-sha256")
        self._busy = self._pool.submit(self._hash.update, chunk)

    def hexdigest(self) -> str:
        self._wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        return self._hash.hexdigest()

    def _wait(self) -> None:
        if self._busy is not None:
            self._busy.result()
            self._busy = None


class DuplicateCounter:
    """Exact count of examples whose 64-bit hash equals an earlier one's, in bounded memory.

    Hashes collect in a flat array (8 bytes each; a set of Python ints would cost ~90). Past
    `max_in_memory` of them, and given a `spill_dir`, they go to disk in SPILL_BUCKETS files by their top
    bits; equal hashes share a bucket, so each bucket is sorted and counted alone at the end. Memory then
    stays under max_in_memory * 8 bytes plus one bucket (1/16 of the hashes: ~40 MB for a 1 GiB file
    of the shortest possible lines). Without a spill_dir the array just grows.
    """

    SPILL_BUCKETS = 16

    def __init__(self, spill_dir: Path | None = None, max_in_memory: int = 4_000_000) -> None:
        self._hashes = array("q")
        self._spill_dir = spill_dir
        self._max_in_memory = max_in_memory
        self._spilled: tempfile.TemporaryDirectory[str] | None = None  # removed when collected, too
        self._count: int | None = None

    def add(self, digest: int) -> None:
        self._hashes.append(digest)
        if self._spill_dir is not None and len(self._hashes) >= self._max_in_memory:
            self._spill()

    def count(self) -> int:
        """Examples minus distinct hashes. The first call counts and frees everything; the count is kept."""
        if self._count is not None:
            return self._count
        import numpy as np  # only here: core stays fast to import

        if self._spilled is None:
            self._count = _repeats(np.frombuffer(self._hashes, dtype=np.int64))
        else:
            self._spill()
            self._count = sum(_repeats(np.fromfile(path, dtype=np.int64)) for path in self._bucket_paths())
            self._spilled.cleanup()
            self._spilled = None
        self._hashes = array("q")
        return self._count

    def _spill(self) -> None:
        import numpy as np

        if self._spilled is None:
            self._spilled = tempfile.TemporaryDirectory(dir=self._spill_dir, prefix="duplicates-")
        hashes = np.frombuffer(self._hashes, dtype=np.int64)
        shift = np.uint64(64 - (self.SPILL_BUCKETS - 1).bit_length())
        buckets = (hashes.view(np.uint64) >> shift).astype(np.uint8)
        for bucket, path in enumerate(self._bucket_paths()):
            with path.open("ab") as f:
                f.write(hashes[buckets == bucket].tobytes())
        del hashes  # releases the array's buffer so it can be replaced
        self._hashes = array("q")

    def _bucket_paths(self) -> list[Path]:
        assert self._spilled is not None
        return [Path(self._spilled.name) / f"{b:02d}" for b in range(self.SPILL_BUCKETS)]


def _repeats(hashes: Any) -> int:
    """How many entries of an int64 numpy array equal an earlier one (sorts it in place)."""
    hashes.sort()
    return int((hashes[1:] == hashes[:-1]).sum())


class ExampleStats:
    """Constant-memory statistics over valid examples: min/mean/max exactly, percentiles from a reservoir."""

    def __init__(self) -> None:
        self.count = 0
        self.chars_sum = 0
        self.chars_min = 0
        self.chars_max = 0
        self.msgs_sum = 0
        self.msgs_min = 0
        self.msgs_max = 0
        self.flagged = 0
        self.with_tools = 0
        self.with_images = 0  # examples holding an image part: admission checks the base reads images
        self.images = 0
        self._chars: list[int] = []
        self._msgs: list[int] = []
        self._rng = random.Random(0)  # fixed seed: the same file gives the same report

    def add(self, chars: int, msgs: int, flag: bool, tools: bool = False, images: int = 0) -> None:
        # Called once per example: plain comparisons, no min()/max() calls.
        self.count += 1
        self.flagged += flag
        self.with_tools += tools
        if images:
            self.with_images += 1
            self.images += images
        if self.count == 1:
            self.chars_min = self.chars_max = chars
            self.msgs_min = self.msgs_max = msgs
        else:
            if chars < self.chars_min:
                self.chars_min = chars
            elif chars > self.chars_max:
                self.chars_max = chars
            if msgs < self.msgs_min:
                self.msgs_min = msgs
            elif msgs > self.msgs_max:
                self.msgs_max = msgs
        self.chars_sum += chars
        self.msgs_sum += msgs
        if self.count <= RESERVOIR_SIZE:
            self._chars.append(chars)
            self._msgs.append(msgs)
        else:
            # Reservoir sampling (algorithm R); random() is C, randrange() is Python.
            j = int(self._rng.random() * self.count)
            if j < RESERVOIR_SIZE:
                self._chars[j] = chars
                self._msgs[j] = msgs

    def summary(self, fmt: Format | None, blank_lines: int) -> dict[str, Any]:
        out: dict[str, Any] = {"blank_lines": blank_lines}
        if not self.count:
            return out
        out["percentiles_exact"] = self.count <= RESERVOIR_SIZE
        out["chars_per_example"] = self._dist(self._chars, self.chars_min, self.chars_sum, self.chars_max)
        if fmt in ("chat", "reinforcement"):
            out["messages_per_example"] = self._dist(self._msgs, self.msgs_min, self.msgs_sum, self.msgs_max)
            out["with_system_message"] = self.flagged
        if fmt in ("chat", "reinforcement", "preference"):
            # examples that define or call tools: admission checks the base model's template renders them
            out["with_tools"] = self.with_tools
        if fmt in ("chat", "reinforcement") and self.with_images:
            out["with_images"], out["images"] = self.with_images, self.images
        if fmt == "instruction":
            out["with_input"] = self.flagged
        if fmt == "chosen_rejected":
            out["with_implicit_prompt"] = self.flagged
        return out

    def _dist(self, sample: list[int], lo: int, total: int, hi: int) -> dict[str, float]:
        ordered = sorted(sample)

        def pct(q: float) -> int:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        return {"min": lo, "mean": round(total / self.count, 2), "p50": pct(0.5), "p95": pct(0.95), "max": hi}
