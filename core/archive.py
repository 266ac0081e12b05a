""".tar.gz archives of stored files: the adapter and merged downloads (worker), a checkpoint (streamed by
the API) and an artifact directory. One list of members, written either as a file or as chunks."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from core.storage import CHECKPOINT_SHARDS_DIR

Member = tuple[Path, str]  # a file or directory on disk (a directory with all below it), its name inside


def flat_files(directory: Path, prefix: str = "") -> Iterator[Member]:
    """The files directly in `directory`, sorted, named `prefix` + their name (subdirectories left out)."""
    for path in sorted(directory.iterdir()):
        if path.is_file():
            yield path, prefix + path.name


def checkpoint_members(directory: Path, prefix: str = "") -> Iterator[Member]:
    """A training checkpoint's files, and its ranks' shards folder whole where it has one (FSDP)."""
    yield from flat_files(directory, prefix)
    shards = directory / CHECKPOINT_SHARDS_DIR
    if shards.is_dir():
        yield shards, prefix + CHECKPOINT_SHARDS_DIR


def write_tar_gz(dst: Path, members: Iterable[Member]) -> Path:
    """The archive as the file `dst`."""
    with tarfile.open(dst, "w:gz") as tar:
        for path, name in members:
            tar.add(path, arcname=name)
    return dst


def stream_tar_gz(members: Iterable[Member]) -> Iterator[bytes]:
    """The archive in chunks, a member at a time: the whole archive is never held."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w|gz") as tar:
        for path, name in members:
            tar.add(path, arcname=name)
            yield buffer.getvalue()
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue()
