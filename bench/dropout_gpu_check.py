"""The hashed LoRA dropout masks on a GPU: host syncs, the same masks as on the CPU, and the time of one
LoRA layer's masked forward+backward against the per-example generators it replaced.

    python bench/dropout_gpu_check.py

A packed micro-batch of 4,096 tokens in 130 examples (alpaca_small's shape in bench/gpu_check.py), 14
modules, bf16, features 2,048 and 5,632 (a 1B Llama's attention and down_proj inputs), lora_dropout 0.05.
"""

from __future__ import annotations

import sys
import time
import types
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
try:
    import pydantic  # noqa: F401
except ImportError:  # a bare GPU machine: training.dropout needs JobSpec as a name only
    sys.modules["core.spec"] = types.SimpleNamespace(JobSpec=object)  # type: ignore[assignment]

from dropout_baseline import masks

from training import dropout
from training.data import Tokenized


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    lengths = (torch.randint(8, 50, (130,), generator=gen)).tolist()
    lengths[-1] += 4096 - sum(lengths)
    items = [Tokenized([1] * n, [1] * n) for n in lengths]
    spec: Any = types.SimpleNamespace(packing=True)  # all dropout.layout reads
    d = dropout.ExampleDropout(0.05, index=7).train()

    def fresh() -> dropout.Layout:
        return dropout.layout(spec, items, range(len(items)), (42, 0))

    # 1. CPU and GPU draw the same mask (integer maths, exact on both)
    d.layout = fresh()
    cpu = d(torch.ones(1, 4096, 256)) == 0
    d.layout = fresh()
    gpu = d(torch.ones(1, 4096, 256, device=dev)) == 0
    print(f"same masks on CPU and GPU: {torch.equal(cpu, gpu.cpu())}, dropped {cpu.float().mean():.4f}")

    # 2. host syncs in 14 modules' forward+backward of a fresh micro-batch (its tokens' keys made in it)
    x = torch.randn(1, 4096, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
    mods = [dropout.ExampleDropout(0.05, index=i).train() for i in range(14)]
    d.layout = fresh()
    d(x).sum().backward()  # warm-up (feature keys, kernels)
    torch.cuda.synchronize()
    where = fresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for m in mods:
                m.layout = where
            sum(m(x).float().sum() for m in mods).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found = [
        w for w in caught if "synchroniz" in str(w.message).lower() and "prototype" not in str(w.message)
    ]
    print(f"host syncs in 14 modules' forward+backward: {len(found)}")
    for w in found[:3]:
        print("   ", str(w.message)[:200])

    # 3. modules' masked forward+backward on one micro-batch (its layout made once, as in a step), old
    # masks against new; the first module also makes the tokens' keys
    for features in (2048, 5632):
        x = torch.randn(1, 4096, features, device=dev, dtype=torch.bfloat16, requires_grad=True)
        for kind in ("per-example", "hashed", "per-example", "hashed"):
            with masks(kind):
                where = fresh()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for m in mods:
                    m.layout = where
                    m(x).sum().backward()
                torch.cuda.synchronize()
            ms = (time.perf_counter() - start) / len(mods) * 1e3
            print(f"features {features}: {kind:<12} {ms:7.3f} ms a module (forward+backward)")
        for m in mods:
            m.layout = None


if __name__ == "__main__":
    main()
