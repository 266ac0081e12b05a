"""What this worker can train on, reported to the fleet table without importing torch.

FTUNE_WORKER_DEVICES overrides detection: a comma list of GPU types or sizes, e.g. "A100-80GB,A100-80GB"
or "24GB", or "cpu:8GiB" (a CPU worker with 8 GiB). Otherwise nvidia-smi is asked; with no GPU the worker
reports its CPU and RAM.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

from planner.gpus import resolve_gpu


def _ram_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _nvidia_gpus() -> list[dict[str, Any]]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, mib = (part.strip() for part in line.rsplit(",", 1))
        gpus.append({"name": name, "kind": "cuda", "memory_bytes": int(float(mib)) * 2**20})
    return gpus


def declared_device(text: str) -> dict[str, Any]:
    """One declared device: a GPU type or size ("A100-80GB", "24GB"), or "cpu:<RAM>" ("cpu:2GiB") for a
    CPU worker with that much memory (tests run a fleet of differently sized workers on one machine)."""
    kind, _, size = text.partition(":")
    if kind.strip().lower() == "cpu":
        memory = resolve_gpu(size).memory_bytes if size.strip() else _ram_bytes()
        return {"name": "cpu", "kind": "cpu", "memory_bytes": memory}
    return {"name": text, "kind": "declared"}


def detect_devices(override: str = "") -> list[dict[str, Any]]:
    if override.strip():
        return [declared_device(d.strip()) for d in override.split(",") if d.strip()]
    return _nvidia_gpus() or [{"name": "cpu", "kind": "cpu", "memory_bytes": _ram_bytes()}]
