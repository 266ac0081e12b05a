"""Lines of an upload that are stored other than as sent: a chat row whose fetched images are inlined as
data: URLs (core.data.images). The upload streams to disk as it arrives, before its lines are checked, so
the replacements wait in an anonymous spill file (gone with the process, whatever happens) and the stored
file is written once the upload is known to be valid, line by line, in one pass over the received file.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import IO


class LineRewrites:
    """Replacement lines by 1-based line number; memory holds their places, the spill file their bytes."""

    def __init__(self, spill_dir: Path | None = None) -> None:
        self._spill_dir = spill_dir
        self._spill: IO[bytes] | None = None
        self._at: dict[int, tuple[int, int]] = {}  # line number -> (offset, length) in the spill file

    def __len__(self) -> int:
        return len(self._at)

    def add(self, line_no: int, line: bytes) -> None:
        """Store `line` (without its newline) in place of line `line_no`."""
        if self._spill is None:
            # closed by close(); unlinked at once, so nothing is left behind whatever happens
            self._spill = tempfile.TemporaryFile(dir=self._spill_dir, prefix="rewrites-")  # noqa: SIM115
        offset = self._spill.seek(0, os.SEEK_END)
        self._spill.write(line)
        self._at[line_no] = (offset, len(line))

    def apply(self, path: Path) -> tuple[int, str]:
        """Rewrite the file at `path` with the replacements, atomically: its new size and sha256. Lines
        keep their order and their newlines; the others keep their bytes."""
        out = path.with_name(path.name + ".rewritten")
        digest, size = hashlib.sha256(), 0
        try:
            with path.open("rb") as src, out.open("wb") as dst:
                for line_no, raw in enumerate(src, 1):
                    if line_no in self._at:
                        raw = self._read(line_no) + (b"\n" if raw.endswith(b"\n") else b"")
                    dst.write(raw)
                    digest.update(raw)
                    size += len(raw)
            os.replace(out, path)
        finally:
            out.unlink(missing_ok=True)
        return size, digest.hexdigest()

    def close(self) -> None:
        if self._spill is not None:
            self._spill.close()
            self._spill = None
        self._at.clear()

    def _read(self, line_no: int) -> bytes:
        assert self._spill is not None
        offset, length = self._at[line_no]
        self._spill.seek(offset)
        return self._spill.read(length)
