"""A kept checkpoint's adapter as a PEFT adapter directory, so that its `ft:...:ckpt-step-N` model is served.

A checkpoint holds the trainable weights under their parameter names (`...q_proj.lora_A.default.weight`,
training/checkpoint.py); an engine loads PEFT's layout (`adapter_config.json` + `adapter_model.safetensors`
keyed `...q_proj.lora_A.weight`). The job's final adapter was saved from the same parameters, so it fixes
both the config and the exact keys, shapes and dtypes; the checkpoint's tensors are copied under those keys.
Only safetensors headers are parsed and the tensors' bytes copied: no torch, so the API can do it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from core.storage import fsync_path

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
CHECKPOINT_WEIGHTS = "adapter.safetensors"  # training.checkpoint's FILES[0]
ADAPTER_NAME = "default"  # the trained adapter's name in the parameter names (training.export)
MAX_HEADER = 100 * 2**20


class NotServable(ValueError):
    """The checkpoint's weights do not match the job's final adapter (they cannot be served as it)."""


def peft_view(checkpoint: Path, final_adapter: Path, dest: Path) -> Path:
    """`dest` as the PEFT adapter of `checkpoint`, written once (atomically; a concurrent writer's result is
    kept). FileNotFoundError when the checkpoint or the final adapter is gone; NotServable on a mismatch."""
    if (dest / CONFIG).is_file() and (dest / WEIGHTS).is_file():
        return dest
    final_header = _header(final_adapter / WEIGHTS)[0]
    config = (final_adapter / CONFIG).read_bytes()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".tmp-{dest.name}-"))
    try:
        _write_weights(checkpoint / CHECKPOINT_WEIGHTS, final_header, tmp / WEIGHTS)
        (tmp / CONFIG).write_bytes(config)
        for f in (tmp / WEIGHTS, tmp / CONFIG):
            fsync_path(f)
        try:
            os.rename(tmp, dest)  # fails if another writer got there first: theirs is the same
        except OSError:
            if not (dest / WEIGHTS).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def peft_key(name: str) -> str:
    """A parameter's name as PEFT saves it: without the adapter's name."""
    return ".".join(part for part in name.split(".") if part != ADAPTER_NAME)


def _write_weights(src: Path, final: dict[str, Any], dst: Path) -> None:
    header, start = _header(src)
    by_key = {peft_key(k): k for k in header if k != "__metadata__"}
    want = [k for k in final if k != "__metadata__"]
    missing = [k for k in want if k not in by_key]
    if missing:
        raise NotServable(f"{src} lacks {len(missing)} of the adapter's tensors, e.g. {missing[0]}")
    for key in want:
        got, expected = header[by_key[key]], final[key]
        if (got["dtype"], got["shape"]) != (expected["dtype"], expected["shape"]):
            raise NotServable(
                f"{key}: {got['dtype']}{got['shape']} in {src}, {expected['dtype']}"
                f"{expected['shape']} in the final adapter"
            )
    out: dict[str, Any] = {"__metadata__": final["__metadata__"]} if "__metadata__" in final else {}
    offset = 0
    for key in want:
        begin, end = header[by_key[key]]["data_offsets"]
        out[key] = {**final[key], "data_offsets": [offset, offset + end - begin]}
        offset += end - begin
    text = json.dumps(out, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with src.open("rb") as f, dst.open("wb") as g:
        g.write(struct.pack("<Q", len(text)) + text)
        for key in want:
            begin, end = header[by_key[key]]["data_offsets"]
            f.seek(start + begin)
            _copy(f, g, end - begin)


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header and where its data starts."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise NotServable(f"{path} is not a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > MAX_HEADER:
            raise NotServable(f"{path} has a header of {size} bytes")
        try:
            header = json.loads(f.read(size))
        except ValueError as e:
            raise NotServable(f"{path} is not a safetensors file: {e}") from e
    if not isinstance(header, dict):
        raise NotServable(f"{path} is not a safetensors file")
    return header, 8 + size


def _copy(src: BinaryIO, dst: BinaryIO, n: int) -> None:
    while n > 0:
        chunk = src.read(min(n, 1 << 20))
        if not chunk:
            raise NotServable(f"{src.name} is shorter than its header says")
        dst.write(chunk)
        n -= len(chunk)
