"""The one owner of file paths. Every path is derived from a validated id, never from user input."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from core.spec import ID_RE

# File names inside a job directory; training.run writes them, the worker and API read them.
RUN_CONFIG = "run.json"
PLAN_FILE = "plan.json"
METRICS_FILE = "metrics.jsonl"
ERROR_FILE = "error.json"
LOG_FILE = "train.log"
CHECKPOINTS_DIR = "checkpoints"
ADAPTER_DIR = "adapter"
ADAPTER_ARCHIVE = "adapter.tar.gz"
MERGED_DIR = "merged"
MERGED_ARCHIVE = "merged.tar.gz"


def new_id() -> str:
    return uuid.uuid4().hex


def _checked(id_: str) -> str:
    if not ID_RE.match(id_):
        raise ValueError(f"not an id: {id_!r}")
    return id_


class Storage:
    """Layout under data_dir:

    datasets/<dataset_id>.jsonl
    jobs/<job_id>/run.json            what training.run reads
    jobs/<job_id>/plan.json           the memory plan the job was admitted on (for the dashboard)
    jobs/<job_id>/metrics.jsonl       one JSON object per line, appended by training
    jobs/<job_id>/error.json          written by training when it fails with a known cause
    jobs/<job_id>/train.log           the training process's stdout and stderr
    jobs/<job_id>/checkpoints/step-<n>/
    jobs/<job_id>/adapter/            final adapter (safetensors + adapter_config.json + README.md)
    jobs/<job_id>/adapter.tar.gz      the download
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def ensure(self) -> None:
        for sub in ("datasets", "jobs", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def dataset_path(self, dataset_id: str) -> Path:
        return self.root / "datasets" / f"{_checked(dataset_id)}.jsonl"

    def job_dir(self, job_id: str) -> Path:
        return self.root / "jobs" / _checked(job_id)

    def run_config_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / RUN_CONFIG

    def plan_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / PLAN_FILE

    def metrics_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / METRICS_FILE

    def error_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / ERROR_FILE

    def log_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / LOG_FILE

    def checkpoints_dir(self, job_id: str) -> Path:
        return self.job_dir(job_id) / CHECKPOINTS_DIR

    def adapter_dir(self, job_id: str) -> Path:
        return self.job_dir(job_id) / ADAPTER_DIR

    def adapter_archive(self, job_id: str) -> Path:
        return self.job_dir(job_id) / ADAPTER_ARCHIVE

    def merged_archive(self, job_id: str) -> Path:
        return self.job_dir(job_id) / MERGED_ARCHIVE

    def temp_file(self) -> Path:
        """A fresh file path on the same filesystem as the data, so a rename into place is atomic."""
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=self.root / "tmp")
        os.close(fd)
        return Path(name)

    def delete_job_files(self, job_id: str) -> None:
        shutil.rmtree(self.job_dir(job_id), ignore_errors=True)


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """A fresh temp dir next to `target` to fill; when the block succeeds it replaces `target` in one
    rename, so readers see the old directory or the complete new one. Removed on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".tmp-{target.name}-"))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, then rename over the target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())
