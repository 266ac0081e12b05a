"""LoRA dropout masks per example: the hashed masks (training.dropout) against the per-example generators
they replaced, in the real training step on this machine.

    .venv/bin/python bench/dropout_masks.py [--steps 3] [--rounds 3] [--tokens 1024]

For the demo model (~5M params) and a ~50M-param Llama config, LoRA r16 on every linear, lora_dropout
0.1: a packed micro-batch of --tokens tokens made of short examples (16-64 tokens, so many examples per
row: where a loop over examples costs most) and a padded one of 4 rows of a quarter of that. Each row
runs the step with the old masks ("per-example", a torch.Generator and a rand per example and module,
kept verbatim as the baseline in bench/dropout_baseline.py), the new ones ("hashed") and no dropout,
interleaved over --rounds rounds (the machine may be shared); tokens/s is the median over rounds of the
timed steps' mean.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dropout_baseline import masks

from core.spec import JobSpec
from training.data import Tokenized
from training.demo import DemoSize, build_demo_model
from training.model import load_model, trainable_parameters
from training.objectives.sft.step import train_step
from training.step import Parts, make_optimizer

SIZES = {
    "demo-5M": DemoSize(),
    "llama-50M": DemoSize(
        hidden_size=640, num_layers=10, num_heads=10, num_kv_heads=5, intermediate_size=1728
    ),
}


def make_run(
    model_dir: Path, packing: bool, p: float, args: argparse.Namespace
) -> tuple[Callable[[], float], int]:
    """A model and optimizer ready to step; returns (one timed call: seconds per step, tokens a step)."""
    rows = 1 if packing else 4
    per_row = args.tokens if packing else args.tokens // 4
    spec = JobSpec(base_model="bench", dataset_id="benchmark01", packing=packing, micro_batch_size=rows,
                   gradient_accumulation_steps=1, max_seq_len=per_row, lora_r=16, lora_dropout=p,
                   lora_target_modules="all-linear")  # fmt: skip
    torch.manual_seed(0)
    model = load_model(spec, model_dir, torch.device("cpu"))
    params = [q for _, q in trainable_parameters(model)]
    parts = Parts(spec, model, make_optimizer(spec, params), params, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    items: list[Tokenized] = []
    steps = []
    for _ in range(args.steps + 1):
        step = []
        for _ in range(rows):
            row, used = [], 0
            while True:
                n = int(torch.randint(16, 65, (1,), generator=gen)) if packing else per_row
                if used + n > per_row:
                    break
                ids = torch.randint(10, 3000, (n,), generator=gen).tolist()
                row.append(len(items))
                items.append(Tokenized(ids, ids))
                used += n
            step.append(row)
        steps.append(step)
    model.train()

    def timed() -> float:
        train_step(parts, items, 0, steps[0], lr=1e-4, dropout_key=(0, 0))  # warm-up
        start = time.perf_counter()
        for k in range(1, args.steps + 1):
            train_step(parts, items, 0, steps[k], lr=1e-4, dropout_key=(0, 0))
        return (time.perf_counter() - start) / args.steps

    tokens = sum(len(items[i].input_ids) for row in steps[1] for i in row)
    examples = sum(len(row) for row in steps[1])
    print(f"  ({examples} examples, {tokens} tokens a step)", end="", flush=True)
    return timed, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens a micro-batch")
    parser.add_argument("--models", nargs="*", default=list(SIZES))
    args = parser.parse_args()

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; lora_dropout 0.1, LoRA r16 all-linear"
    )
    print(f"{args.steps} timed steps a round, median of {args.rounds} rounds\n")
    header = f"{'model':<10} {'batch':<7} {'masks':<12} {'tok/s':>8} {'s/step':>7}"
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model_dir = build_demo_model(Path(tmp), name=name, size=SIZES[name])
            for packing in (True, False):
                batch = "packed" if packing else "padded"
                print(f"{name} {batch}", end="", flush=True)
                runs = {kind: make_run(model_dir, packing, 0.0 if kind == "none" else 0.1, args)
                        for kind in ("per-example", "hashed", "none")}  # fmt: skip
                print()
                times: dict[str, list[float]] = {kind: [] for kind in runs}
                for _ in range(args.rounds):
                    for kind, (timed, _) in runs.items():
                        with masks(kind):
                            times[kind].append(timed())
                print(header)
                for kind, (_, tokens) in runs.items():
                    s = statistics.median(times[kind])
                    label = "no dropout" if kind == "none" else kind
                    print(f"{name:<10} {batch:<7} {label:<12} {tokens / s:>8.0f} {s:>7.3f}")
                print(flush=True)


if __name__ == "__main__":
    main()
