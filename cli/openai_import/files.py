"""Files: each file of the source, by id with its purpose, copied once into ftune.

The content streams down to a temporary file (never held in memory) and is uploaded with the same
filename and purpose and an Idempotency-Key made from the source id: ftune answers a second upload under
that key with the first file (Idempotent-Replayed: true), so a rerun copies nothing twice.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import openai
from openai.types import FileObject

from cli.openai_import.endpoints import Endpoints
from cli.openai_import.report import Outcome, Report

PURPOSE: Literal["fine-tune"] = "fine-tune"  # the one purpose ftune stores
PENDING = "0" * 32  # a dry run's stand-in for the id a file will get when it is copied
CHUNK = 1 << 20


@dataclass
class FileMap:
    """Source file id -> its ftune id (PENDING: a dry run would copy it); `why` a file is not there."""

    ids: dict[str, str] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)

    def missing(self, file_id: str) -> str | None:
        """Why a job cannot use this source file in ftune ("was not moved: ..."), or None if it can."""
        if file_id in self.ids:
            return None
        return self.why.get(file_id, "is not among the source's files (deleted there?)")


def _size(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    size = float(n)
    for unit in ("KB", "MB", "GB"):
        size /= 1000
        if size < 1000 or unit == "GB":
            return f"{size:.1f} {unit}"
    raise AssertionError("unreachable")


def describe(f: FileObject) -> str:
    return f"{f.filename} ({_size(f.bytes)}, purpose {f.purpose})"


def _upload(ep: Endpoints, f: FileObject) -> tuple[FileObject, bool]:
    """(ftune's file, whether ftune had it already under this source id's Idempotency-Key)."""
    with tempfile.TemporaryDirectory(prefix="ftune-import-") as tmp:
        path = Path(tmp) / "content"
        with ep.source.with_streaming_response.files.content(f.id) as down, path.open("wb") as out:
            for chunk in down.iter_bytes(CHUNK):
                out.write(chunk)
        with path.open("rb") as content:
            raw = ep.dest.files.with_raw_response.create(
                file=(f.filename, content), purpose=PURPOSE, extra_headers=ep.idempotency_key("file", f.id)
            )
    return raw.parse(), raw.headers.get("idempotent-replayed") == "true"


def _still_there(ep: Endpoints, file_id: str) -> bool:
    try:
        ep.dest.files.retrieve(file_id)
    except openai.NotFoundError:
        return False
    return True


def copy_one(
    ep: Endpoints, f: FileObject, dry_run: bool, known: str | None
) -> tuple[Outcome, str | None, str]:
    """(outcome, ftune's id, detail) for one source file; `known`: its ftune id, if already known."""
    what = describe(f)
    if f.purpose != PURPOSE:
        return Outcome.NOT_MOVED, None, f"{what}: ftune stores fine-tuning files only (purpose {PURPOSE!r})"
    if known is not None:
        return Outcome.THERE, known, what
    if dry_run:
        return Outcome.MOVED, None, what
    try:
        copy, replayed = _upload(ep, f)
    except openai.APIStatusError as e:
        return Outcome.NOT_MOVED, None, f"{what}: {ep.reason(e)}"
    if replayed:
        if not _still_there(ep, copy.id):
            return Outcome.NOT_MOVED, None, f"{what}: copied before as {copy.id}, deleted in ftune since"
        return Outcome.THERE, copy.id, what
    if copy.status == "error":  # stored, but no job can train on it: said here, and on each job that names it
        return Outcome.MOVED, copy.id, f"{what}; ftune finds it invalid: {(copy.status_details or '')[:300]}"
    return Outcome.MOVED, copy.id, what


def copy_files(ep: Endpoints, report: Report, known: dict[str, str]) -> FileMap:
    """Every file of the source (the SDK walks every page), oldest first. `known`: source id -> ftune id of
    files ftune is known to hold (the files of jobs imported before)."""
    files = sorted(ep.source.files.list(), key=lambda f: (f.created_at, f.id))
    out = FileMap()
    for f in files:
        outcome, dest_id, detail = copy_one(ep, f, report.dry_run, known.get(f.id))
        report.add("file", f.id, outcome, dest_id, detail)
        if outcome is Outcome.NOT_MOVED:
            out.why[f.id] = f"was not moved: {detail}"
        else:
            out.ids[f.id] = dest_id or PENDING
    return out
