"""Real (non-padding) tokens/s of packed vs padded LoRA training of the demo model, side by side.

    .venv/bin/python bench/packing.py [--steps 20] [--micro-batch 4] [--seq-len 512] [--examples 4000]

The dataset is generated: token lengths lognormal with median ~150 and a long tail clipped at
max_seq_len, random token ids, the first 20-60% of each example masked as its prompt. Four trainers
run the same number of optimizer steps through the real training step (training.objectives.sft.step),
their steps interleaved so that load from other work on the machine hits all of them alike:

- padded: plain padded batches, the baseline of the goal (packed >= 1.5x padded): shuffled micro-batches
  of micro_batch_size examples, each padded to its longest, SDPA + padding mask. This is what the common
  SFT trainers do by default (no length grouping).
- grouped: ftune's `packing: false`, the same but length-grouped (training.batches.epoch_steps), the
  other way to waste little on padding.
- packed: ftune's default `packing: true`, up to micro_batch_size * max_seq_len tokens per micro-batch,
  attention per example (training.packing's ftune_packed).
- packed-dense: the same packed batches on plain SDPA, where transformers turns the restarting
  position ids into a dense block-diagonal mask over the whole row: the trap the packed path avoids.

Columns: padding = share of the token slots the model computes on that are padding; attn work =
attention scores computed / scores needed (sum of n_i^2 over examples); tok/s = real tokens per wall
second and per process-CPU second (all threads). On a shared machine wall time swings a lot between
runs; `--threads 1` with the CPU column is the steadiest comparison.

What to expect on a 2-core CPU (2026-11-23, 20 steps, idle machine): packed 1.85-2.0x padded, 1.0-1.1x
grouped, 2.1-2.3x packed-dense. Skipping padding can give at most slots / real tokens (printed as 'padding
alone'): ~2x over plain padded batches, but only 1.03x over length-grouped ones, which pad ~3%. A real
token costs the same in grouped and packed batches (matmuls are ~half of the step either way), so
packing cannot beat length grouping by much on speed; what it adds is batches that mix lengths
at random instead of grouping them, with steady tokens per step.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.spec import JobSpec
from training.batches import Step, epoch_steps, split_step
from training.data import IGNORE, Tokenized
from training.demo import build_demo_model
from training.model import load_model, trainable_parameters
from training.objectives.sft.step import train_step
from training.step import Parts, StepResult, make_optimizer


def make_items(n: int, max_seq_len: int, seed: int = 0) -> list[Tokenized]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(150), 0.9, n), 16, max_seq_len).astype(int)
    items = []
    for length in lengths.tolist():
        ids = rng.integers(10, 4000, length).tolist()
        prompt = int(length * rng.uniform(0.2, 0.6))
        items.append(Tokenized(ids, [IGNORE] * prompt + ids[prompt:]))
    return items


@dataclass
class Mode:
    name: str
    parts: Parts
    items: list[Tokenized]
    order: Callable[[int], list[Step]]  # an epoch's steps
    epoch: int = 0
    index: int = 0  # next step within the epoch
    wall: float = 0.0  # seconds
    cpu: float = 0.0  # process CPU seconds, all threads: less sensitive to other work on the machine
    real: int = 0  # non-padding tokens
    slots: int = 0  # token positions computed on, padding included
    scores: int = 0  # attention scores computed (per head and layer)
    needed: int = 0  # attention scores that a per-example attention needs
    first_loss: float | None = None


def make_mode(name: str, model_dir: Path, items: list[Tokenized], packing: bool, dense: bool, args) -> Mode:
    spec = JobSpec(
        base_model="bench",
        dataset_id="benchmark01",
        packing=packing,
        micro_batch_size=args.micro_batch,
        max_seq_len=args.seq_len,
        lora_r=16,
        lora_dropout=0.0,
        epochs=1,
    )
    torch.manual_seed(0)
    # packed-dense: packed batches, but a model loaded for padded ones (plain SDPA).
    model_spec = spec.model_copy(update={"packing": False}) if dense else spec
    model = load_model(model_spec, model_dir, torch.device("cpu"))
    params = [p for _, p in trainable_parameters(model)]
    lengths = [len(t.input_ids) for t in items]
    parts = Parts(spec, model, make_optimizer(spec, params), params, torch.device("cpu"))
    return Mode(name, parts, items, lambda epoch: epoch_steps(spec, lengths, epoch))


def plain_padded(m: Mode) -> Mode:
    """The same mode with plain shuffled micro-batches, no length grouping: the padded baseline."""
    n, size = len(m.items), m.parts.spec.micro_batch_size

    def order(epoch: int) -> list[Step]:
        perm = np.random.default_rng([m.parts.spec.seed, epoch]).permutation(n).tolist()
        return [[[i] for i in perm[j : j + size]] for j in range(0, n, size)]

    m.order = order
    return m


def next_step(m: Mode) -> Step:
    steps = m.order(m.epoch)
    step = steps[m.index]
    m.index += 1
    if m.index == len(steps):
        m.epoch, m.index = m.epoch + 1, 0
    return step


def run_step(m: Mode, step: Step) -> StepResult:
    return train_step(m.parts, m.items, 0, step, lr=m.parts.spec.learning_rate)


def account(m: Mode, step: Step) -> None:
    """Count the work of a step."""
    spec = m.parts.spec
    lengths = [len(t.input_ids) for t in m.items]
    for idx in split_step(spec, lengths, step):
        lens = [lengths[i] for i in idx]
        m.real += sum(lens)
        m.needed += sum(n * n for n in lens)
        if not spec.packing:
            m.slots += len(lens) * max(lens)
            m.scores += len(lens) * max(lens) ** 2
        else:
            m.slots += sum(lens)
            m.scores += sum(lens) ** 2 if m.name == "packed-dense" else sum(n * n for n in lens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed optimizer steps per mode")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--examples", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--modes", nargs="*", default=["padded", "grouped", "packed", "packed-dense"])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    items = make_items(args.examples, args.seq_len)
    lengths = np.array([len(t.input_ids) for t in items])
    threads, load = torch.get_num_threads(), os.getloadavg()[0]
    print(f"torch {torch.__version__}, {threads} threads, load average {load:.1f}")
    print(
        f"{len(items)} examples, tokens p50 {np.median(lengths):.0f} mean {lengths.mean():.0f} "
        f"p95 {np.percentile(lengths, 95):.0f} max {lengths.max()}; micro-batch {args.micro_batch}, "
        f"max_seq_len {args.seq_len}; {args.steps} timed steps per mode (+1 warm-up), interleaved"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_demo_model(Path(tmp))
        build = {
            "padded": lambda: plain_padded(make_mode("padded", model_dir, items, False, False, args)),
            "grouped": lambda: make_mode("grouped", model_dir, items, False, False, args),
            "packed": lambda: make_mode("packed", model_dir, items, True, False, args),
            "packed-dense": lambda: make_mode("packed-dense", model_dir, items, True, True, args),
        }
        modes = [build[name]() for name in args.modes]
        for m in modes:
            m.parts.model.train()
            m.first_loss = run_step(m, next_step(m)).loss  # warm-up: allocations, optimizer state
        for _ in range(args.steps):
            for m in modes:  # interleaved: load from other work hits every mode alike
                real_before = m.real
                step = next_step(m)
                account(m, step)
                wall, cpu = time.perf_counter(), time.process_time()
                result = run_step(m, step)
                m.wall += time.perf_counter() - wall
                m.cpu += time.process_time() - cpu
                assert result.tokens == m.real - real_before  # the loop counts what account() does
    print(f"load average after: {os.getloadavg()[0]:.1f}\n")
    report(modes)


def report(modes: list[Mode]) -> None:
    base = next((m for m in modes if m.name == "padded"), modes[0])
    header = (
        f"{'mode':<14}{'real tok':>9}{'slots':>8}{'padding':>8}{'attn work':>10}{'wall s':>8}{'cpu s':>8}"
        f"{'tok/s wall':>11}{'tok/s cpu':>10}{'x wall':>7}{'x cpu':>7}"
    )
    print(header)
    print("-" * len(header))
    for m in modes:
        wall, cpu = m.real / m.wall, m.real / m.cpu
        print(
            f"{m.name:<14}{m.real:>9}{m.slots:>8}{1 - m.real / m.slots:>8.1%}{m.scores / m.needed:>9.2f}x"
            f"{m.wall:>8.1f}{m.cpu:>8.1f}{wall:>11.0f}{cpu:>10.0f}"
            f"{wall / (base.real / base.wall):>6.2f}x{cpu / (base.real / base.cpu):>6.2f}x"
        )
    print(
        "\npadding: share of computed token slots that are padding; attn work: attention scores computed"
        f" / scores needed (sum of n_i^2); tok/s: real tokens per wall / process-CPU second;"
        f" x: vs {base.name}"
    )
    packed = next((m for m in modes if m.name == "packed"), None)
    if packed:
        print(
            "\npacked vs the others; 'padding alone' is what skipping the padding could give if a real token"
            " cost the same either way (slots / real tokens):"
        )
        for m in modes:
            if m is packed:
                continue
            goal = " (goal >= 1.50x)" if m.name == "padded" else ""
            print(
                f"  vs {m.name:<13} {(packed.real / packed.wall) / (m.real / m.wall):.2f}x wall, "
                f"{(packed.real / packed.cpu) / (m.real / m.cpu):.2f}x cpu{goal}; "
                f"padding alone {m.slots / m.real:.2f}x"
            )
        print(f"packed attention work: {packed.scores / packed.needed:.2f}x of the per-example need")
    losses = ", ".join(f"{m.name} {m.first_loss:.4f}" for m in modes)
    print(f"warm-up step loss (packed and packed-dense train on the same batch): {losses}")


if __name__ == "__main__":
    main()
