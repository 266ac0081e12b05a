"""Registering finished files as Artifacts: sizes, sha256 and the adapter download archive."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from core.archive import flat_files, write_tar_gz
from core.storage import ADAPTER_ARCHIVE, ADAPTER_DIR


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def sha256_dir(path: Path) -> tuple[int, str]:
    """Total size and a sha256 over (relative name, content hash) of every file, in sorted order."""
    h = hashlib.sha256()
    size = 0
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        size += f.stat().st_size
        h.update(f"{f.relative_to(path).as_posix()}\0{sha256_file(f)}\n".encode())
    return size, h.hexdigest()


def build_adapter_archive(job_dir: Path) -> Path:
    """Pack adapter/ into adapter.tar.gz (flat: adapter_config.json, adapter_model.safetensors, ...)."""
    src = job_dir / ADAPTER_DIR
    if not (src / "adapter_model.safetensors").is_file() or not (src / "adapter_config.json").is_file():
        raise FileNotFoundError("training finished without adapter_model.safetensors and adapter_config.json")
    return build_archive(src, job_dir / ADAPTER_ARCHIVE)


def build_archive(src: Path, dst: Path) -> Path:
    """Pack the files of `src` flat into the .tar.gz `dst`, renamed into place when complete."""
    tmp = dst.with_name(dst.name + ".tmp")
    os.replace(write_tar_gz(tmp, flat_files(src)), dst)
    return dst
