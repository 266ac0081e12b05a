"""GPUs the planner knows: memory (as nvidia-smi reports the total) and dense bf16 tensor throughput.

`resolve_gpu` accepts a GPU type ("A100-80GB", "a100 80gb", "H100", "4090"; case, spaces, dashes and
underscores do not matter) or a bare memory size ("24GB", "80GiB", "16g"). A GPU vendor's "GB" of
GPU memory is a GiB (the A100 80GB has 81920 MiB), so GB and GiB both mean 2**30 bytes here.

Usable memory = memory - reserve, the reserve (2% of memory, at least 256 MiB) standing for what the
driver and other processes keep outside this job's process. The job's own CUDA context is not in
the reserve: the planner reports it as a term of its own.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

from core.errors import InvalidInput

MiB = 2**20
GiB = 2**30
RESERVE_FRACTION = 0.02
RESERVE_MIN_BYTES = 256 * MiB


class Gpu(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    memory_bytes: int
    bf16_flops: float | None = None  # dense (not sparse) bf16 tensor FLOP/s; fp16 where no bf16
    bf16_supported: bool = True  # Volta/Turing have no bf16: mixed precision "auto" means fp16 there
    kind: str = "cuda"  # "cpu": a CPU worker's RAM (no CUDA context, no CUDA-only workspaces)

    @property
    def reserve_bytes(self) -> int:
        return max(RESERVE_MIN_BYTES, int(self.memory_bytes * RESERVE_FRACTION))

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserve_bytes


def _g(name: str, mib: int, tflops: float, bf16: bool = True) -> Gpu:
    return Gpu(name=name, memory_bytes=mib * MiB, bf16_flops=tflops * 1e12, bf16_supported=bf16)


# memory: nvidia-smi "Total" (MiB); throughput: vendor datasheets, dense, fp32 accumulate for GeForce.
GPUS: dict[str, Gpu] = {
    g.name.lower(): g
    for g in (
        _g("T4", 15360, 65, bf16=False),
        _g("V100-16GB", 16160, 125, bf16=False),
        _g("V100-32GB", 32510, 125, bf16=False),
        _g("RTX-3060", 12288, 25.5),
        _g("RTX-3090", 24576, 71),
        _g("RTX-4090", 24564, 165),
        _g("RTX-A5000", 24564, 111),
        _g("RTX-A6000", 49140, 155),
        _g("RTX-6000-Ada", 49140, 364),
        _g("L4", 23034, 121),
        _g("A10G", 23028, 70),
        _g("A10", 23028, 125),
        _g("A40", 46068, 150),
        _g("L40", 46068, 181),
        _g("L40S", 46068, 362),
        _g("A100-40GB", 40960, 312),
        _g("A100-80GB", 81920, 312),
        _g("H100-80GB", 81559, 989),
        _g("H100-PCIe", 81559, 756),
        _g("H100-NVL", 95830, 835),
        _g("H200", 143771, 989),
        _g("B200", 183359, 2250),
    )
}

_ALIASES = {
    "t4": "t4",
    "teslat4": "t4",
    "v100": "v100-16gb",
    "v10016gb": "v100-16gb",
    "v10032gb": "v100-32gb",
    "3060": "rtx-3060",
    "3090": "rtx-3090",
    "3090ti": "rtx-3090",
    "4090": "rtx-4090",
    "a5000": "rtx-a5000",
    "a6000": "rtx-a6000",
    "6000ada": "rtx-6000-ada",
    "a100": "a100-80gb",
    "a10040gb": "a100-40gb",
    "a10080gb": "a100-80gb",
    "a100sxm440gb": "a100-40gb",
    "a100sxm480gb": "a100-80gb",
    "h100": "h100-80gb",
    "h100sxm": "h100-80gb",
    "h10080gb": "h100-80gb",
    "h100sxm580gb": "h100-80gb",
    "h100pcie": "h100-pcie",
    "h100nvl": "h100-nvl",
    "h200": "h200",
    "b200": "b200",
}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gb|gib|g|mb|mib|m)\s*$", re.IGNORECASE)


def _key(name: str) -> str:
    k = re.sub(r"[\s_\-]", "", name.lower())
    for prefix in ("nvidia", "geforce", "tesla", "quadro"):
        k = k.removeprefix(prefix)
    return k.removeprefix("rtx") if k.removeprefix("rtx")[:1].isdigit() else k


def resolve_gpu(name_or_size: str) -> Gpu:
    """A GPU by type (case-insensitive, a few aliases) or by memory size ("24GB", "80GiB")."""
    text = name_or_size.strip()
    m = _SIZE_RE.match(text)
    if m:
        amount, unit = float(m.group(1)), m.group(2).lower()
        size = int(amount * (GiB if unit.startswith("g") else MiB))
        if size < GiB:
            raise InvalidInput(f"GPU memory {text!r} is too small", param="gpu")
        return Gpu(name=f"{amount:g}GiB GPU", memory_bytes=size, bf16_flops=None)
    key = _key(text)
    by_key = {_key(n): n for n in GPUS}
    found = by_key.get(key) or _ALIASES.get(key)
    if found is None:
        raise InvalidInput(
            f"unknown GPU {name_or_size!r}; give a memory size like '24GB' or one of "
            f"{[g.name for g in GPUS.values()]}",
            param="gpu",
        )
    return GPUS[found]
