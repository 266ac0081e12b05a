"""`ftune up`'s inference engine beside its training worker, planned together on the same memory.

The engine (`python -m inference.server`) keeps one base model and up to MAX_ADAPTERS adapters resident,
on the device training would use (training.model.pick_device: the first GPU, else the CPU). Its memory
bound is planner.serving's, for the largest base model in the catalog, since it may be asked for any.
The training worker then declares that device's memory minus the bound (FTUNE_WORKER_DEVICES), so the
planner never admits a job that fits only if the engine were not there; the engine holds itself to the
bound (--memory-bytes). docs/inference.md says the same for operators.
"""

from __future__ import annotations

from typing import Any

from core.arch import load_architecture
from core.catalog import Catalog
from core.errors import FtuneError
from planner.gpus import resolve_gpu
from planner.serving import serving_bytes

MAX_ADAPTERS = 8  # resident per base; the engine evicts the least recently used beyond it
MAX_LORA_RANK = 64  # the rank adapters are counted at (vLLM's --max-lora-rank in docs/inference.md)
MiB = 2**20


def engine_bound(catalog: Catalog, max_batch_tokens: int = 2048, max_running: int = 32) -> int:
    """Bytes the engine may use: the serving bound of the largest catalog model (0: no model it can plan),
    for the batch the engine runs (FTUNE_INFERENCE_MAX_BATCH_TOKENS, FTUNE_INFERENCE_MAX_RUNNING)."""
    bound = 0
    for info in catalog.list():
        try:
            arch = load_architecture(info.path)
        except FtuneError:
            continue  # an architecture the planner does not know; the engine refuses it too
        shape = {"max_batch": max_running, "max_batch_tokens": max_batch_tokens}
        bound = max(bound, serving_bytes(arch, max_adapters=MAX_ADAPTERS, lora_r=MAX_LORA_RANK, **shape))
    return bound


def _memory(device: dict[str, Any]) -> int:
    if "memory_bytes" in device:
        return int(device["memory_bytes"])
    return resolve_gpu(str(device["name"])).memory_bytes  # a declared GPU type or size


def training_devices(devices: list[dict[str, Any]], engine_bytes: int) -> str:
    """FTUNE_WORKER_DEVICES for the training worker: its devices by size, the first (the engine's) less
    the engine's bound. Raises when the engine alone does not fit there."""
    first = _memory(devices[0]) - engine_bytes
    if first < 1024 * MiB:  # resolve_gpu's smallest size; training could not run beside the engine anyway
        raise FtuneError(
            f"the inference engine's bound ({engine_bytes / 2**30:.1f} GiB) leaves less than 1 GiB of "
            f"{_memory(devices[0]) / 2**30:.1f} GiB for training; "
            "set FTUNE_INFERENCE_URL to an engine elsewhere",
            code="engine_too_large",
        )
    sizes = [first] + [_memory(d) for d in devices[1:]]
    if devices[0].get("kind") == "cpu":
        return f"cpu:{first // MiB}MiB"
    return ",".join(f"{size // MiB}MiB" for size in sizes)
