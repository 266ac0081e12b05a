"""OpenAI's file objects, built from ftune's Dataset rows (a file is a dataset, under the same id)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from models.tables import Dataset

PURPOSE: Literal["fine-tune"] = "fine-tune"
RESULTS_PURPOSE: Literal["fine-tune-results"] = "fine-tune-results"
FileStatus = Literal["uploaded", "processed", "error"]


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int  # unix seconds
    filename: str
    purpose: Literal["fine-tune", "fine-tune-results"] = PURPOSE
    # ftune validates while the upload streams in, so a file is never seen "uploaded".
    status: FileStatus
    status_details: str | None
    expires_at: int | None = None  # ftune keeps files until they are deleted


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool
    first_id: str | None
    last_id: str | None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


def problems_text(report: dict[str, Any]) -> str:
    """The validator's problems in one line, each with its line number ("line 3: ...")."""
    problems = report.get("problems") or []
    total = sum((report.get("problem_counts") or {}).values()) or len(problems)
    text = f"invalid file, {total} problem(s): " + "; ".join(
        f"{p['message']} [{p['code']}]" for p in problems
    )
    if total > len(problems):
        text += f"; and {total - len(problems)} more"
    return text


def file_object(ds: Dataset) -> FileObject:
    valid = ds.status == "valid"
    return FileObject(
        id=ds.id,
        bytes=ds.size_bytes,
        created_at=int(ds.created_at.timestamp()),
        filename=ds.filename,
        status="processed" if valid else "error",
        status_details=None if valid else problems_text(ds.report),
    )
