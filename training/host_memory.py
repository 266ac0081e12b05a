"""Keep freed host memory for reuse: glibc malloc settings for training on a CPU.

glibc serves every block above its mmap threshold (128 KiB at first, rising to at most 32 MiB as such
blocks are freed) straight from the kernel and returns it on free. A training step makes and frees
the same large activations every step, so on a CPU each of them was fresh pages that the kernel
zeroed and faulted in one at a time: a LoRA matmul of [2048, 16] x [16, 688] took 6.5 ms instead of
0.3 ms, and steps ran 10-20% slower (bench/packing.py, bench/train_throughput.py). With the mmap
threshold at its largest and trimming off, freed blocks stay in the heap for the next step. Resident
memory then stays at the step's peak, which the planner already counts.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's limit on 64-bit systems
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: the largest, ~2 GiB


def reuse_freed_memory() -> bool:
    """Apply the settings to this process; False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # e.g. musl: no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
