"""One LoRA linear's forward without grad, as decoding calls it (a few rows): microseconds per call, side by
side, on this machine's device.

    python bench/lora_layer.py [--rows 16] [--width 128] [--rank 16] [--calls 5000] [--rounds 7]

Rows (the median of --rounds interleaved rounds of --calls calls each; on a GPU the calls are queued and
synchronised once a round, so a row is the host's time per call wherever that exceeds the kernels'):
  base linear alone     F.linear on the frozen weight: the floor without LoRA
  peft's forward        peft's lora.Linear as it comes
  engine's forward      the same layer with training.lora_add installed (what the engine runs)
  its ops alone         F.linear, F.linear and addmm_ written out: the floor with LoRA
On a CPU it runs on one thread, so the time is the host's work, as when a GPU decodes a few rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training import lora_add  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    from peft import LoraConfig, get_peft_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width, bias=False)).to(device)
    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=["0"])
    layer = get_peft_model(model, config).base_model.model[0]
    x = torch.randn(args.rows, 1, args.width, device=device)  # one new token of each sequence
    w, a, b = layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
    scaling = layer.scaling["default"]

    def ops() -> torch.Tensor:
        flat = x.reshape(-1, args.width)
        out = F.linear(flat, w)
        return out.addmm_(F.linear(flat, a), b.t(), alpha=scaling).view(args.rows, 1, args.width)

    def peft_forward() -> None:
        layer.__dict__.pop("forward", None)  # peft's own forward again

    def engine_forward() -> None:
        lora_add.install(model)

    def nothing() -> None:
        pass

    # label, what makes the layer's forward the row's (outside the timed calls), the call timed
    rows: list[tuple[str, Callable[[], None], Callable[[], torch.Tensor]]] = [
        ("base linear alone", nothing, lambda: F.linear(x, w)),
        ("peft's forward", peft_forward, lambda: layer(x)),
        ("engine's forward", engine_forward, lambda: layer(x)),
        ("its ops alone", nothing, ops),
    ]
    with torch.no_grad():
        engine_forward()
        engine_out = layer(x)
        peft_forward()
        torch.testing.assert_close(engine_out, layer(x), rtol=1e-5, atol=1e-5)  # the same layer either way
        times: dict[str, list[float]] = {label: [] for label, _, _ in rows}
        for _ in range(args.rounds):
            for label, prepare, call in rows:
                prepare()
                call()
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[label].append((time.perf_counter() - start) / args.calls * 1e6)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU, 1 thread"
    print(f"{name}: {args.rows} rows x width {args.width}, LoRA r{args.rank}, no grad")
    print(f"{'':20} {'us / call':>10}   (median of {args.rounds} rounds; all rounds)")
    for label, values in times.items():
        print(f"{label:20} {statistics.median(values):10.1f}   {' '.join(f'{v:.1f}' for v in values)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
