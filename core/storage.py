"""The one owner of file paths. Every path is derived from a validated id, never from user input."""

from __future__ import annotations

import ctypes
import errno
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
PLAN_FILE = "plan.json"  # the plan the job runs under: re-made from its data's lengths and on its worker
ADMISSION_PLAN_FILE = "admission-plan.json"  # the plan it was admitted on, kept as it was
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.json"  # the before/after samples, written by the worker from the records
ERROR_FILE = "error.json"
LOG_FILE = "train.log"
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_SHARDS_DIR = "shards"  # in an FSDP checkpoint: each rank's file (training.checkpoint_shards)
ADAPTER_DIR = "adapter"
ADAPTER_ARCHIVE = "adapter.tar.gz"
CHECKPOINT_ADAPTERS_DIR = "checkpoint-adapters"  # kept checkpoints' adapters in PEFT's layout, for serving
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
    jobs/<job_id>/checkpoint-adapters/step-<n>/  a checkpoint's adapter as PEFT's directory, made when served
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

    def admission_plan_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / ADMISSION_PLAN_FILE

    def metrics_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / METRICS_FILE

    def samples_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / SAMPLES_FILE

    def error_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / ERROR_FILE

    def log_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / LOG_FILE

    def checkpoints_dir(self, job_id: str) -> Path:
        return self.job_dir(job_id) / CHECKPOINTS_DIR

    def adapter_dir(self, job_id: str) -> Path:
        return self.job_dir(job_id) / ADAPTER_DIR

    def checkpoint_adapter_dir(self, job_id: str, step: int) -> Path:
        return self.job_dir(job_id) / CHECKPOINT_ADAPTERS_DIR / f"step-{int(step):08d}"

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

    def delete_checkpoint_files(self, job_id: str, step: int, checkpoint: Path) -> None:
        """A checkpoint's directory (inside the job's, or nothing is removed) and the adapter laid out from
        it for serving: the checkpoint is then gone as one keep_checkpoints pruned is."""
        job_dir = self.job_dir(job_id).resolve()
        for path in (checkpoint, self.checkpoint_adapter_dir(job_id, step)):
            if path.resolve().is_relative_to(job_dir) and path.resolve() != job_dir:
                shutil.rmtree(path, ignore_errors=True)


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """A fresh temp dir next to `target` to fill; when the block succeeds it replaces `target`.

    Crash-safe: the files and the new directory are fsynced before the swap, and `target` holds the
    complete old or the complete new directory at every instant (an atomic exchange where the kernel
    has one; else old aside, new in place, with recover_dir() undoing a half-done swap). Removed on
    failure. One writer per target at a time."""
    target.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(target)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".tmp-{target.name}-"))
    try:
        yield tmp
        _fsync_tree(tmp)
        _swap_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def recover_dir(target: Path) -> None:
    """Finish a swap that a crash interrupted: put the old directory back, or drop it if the new one
    is in place. A no-op when nothing was interrupted."""
    aside = _aside(target)
    if not aside.exists():
        return
    if target.exists():
        shutil.rmtree(aside)
    else:
        os.rename(aside, target)
        fsync_path(target.parent)


def _aside(target: Path) -> Path:
    return target.parent / f".old-{target.name}"


def _swap_into_place(tmp: Path, target: Path) -> None:
    if not target.exists():
        os.rename(tmp, target)
        fsync_path(target.parent)
        return
    if _exchange(tmp, target):  # tmp now holds the old directory
        fsync_path(target.parent)
        shutil.rmtree(tmp)
        return
    aside = _aside(target)
    os.rename(target, aside)  # a crash here leaves only `aside`: recover_dir renames it back
    os.rename(tmp, target)
    fsync_path(target.parent)
    shutil.rmtree(aside)


# renameat2(2) flags and the "current directory" fd, from <linux/fs.h> and <fcntl.h>.
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_NO_EXCHANGE = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP}


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2). False where the OS or filesystem has none."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _fsync_tree(root: Path) -> None:
    """Files first, then their directories, so the new tree is on disk before it is swapped in."""
    for dirpath, _dirs, names in os.walk(root, topdown=False):
        for name in names:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def fsync_path(path: Path) -> None:
    """Flush a file (or a directory's entries) to disk: what makes a rename durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
