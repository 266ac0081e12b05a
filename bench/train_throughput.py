"""Training throughput and peak memory of the real training step on this machine.

    .venv/bin/python bench/train_throughput.py [--steps 3] [--batch 4] [--seq-len 256]

For the demo model (~5M params) and a ~50M-param Llama config, LoRA and QLoRA, activation
checkpointing off and on, SFT and DPO (objective dpo: a micro-batch of batch / 2 preference pairs, so
the same batch x seq-len tokens as SFT's, each side a quarter prompt and three quarters reply; the
reference forward, the adapter disabled, runs in every step): tokens/s over timed optimizer steps, the
CPU peak memory of one step (training.memory, see there for what it counts), and the achieved model
FLOP/s as a fraction of the fp32 matmul FLOP/s this machine reaches in the same run.

Model FLOPs per token follow the usual convention (PaLM, appendix B) adapted to LoRA, where the
frozen weights need no weight gradients: 2N forward + 2N backward (input gradients only)
+ 12 * layers * hidden * seq for attention scores (forward and backward); N counts the matmul
weights (embeddings excluded, lm_head included). Recomputation under checkpointing is not useful
work, so it lowers the fraction rather than adding to it. DPO's reference forward is: it adds a forward,
2N + 4 * layers * hidden * seq per token.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.spec import JobSpec
from training.data import Tokenized
from training.demo import DemoSize, build_demo_model
from training.memory import PeakMemory, model_state_tensors
from training.model import load_model, trainable_parameters
from training.objectives.dpo.pairs import Pair
from training.objectives.dpo.step import train_step as dpo_train_step
from training.objectives.sft.step import train_step
from training.step import Parts, make_optimizer

SIZES = {
    "demo-5M": DemoSize(),
    "llama-50M": DemoSize(
        hidden_size=640, num_layers=10, num_heads=10, num_kv_heads=5, intermediate_size=1728
    ),
}


def matmul_flops(n: int = 1024, seconds: float = 2.0) -> float:
    """Sustained fp32 matmul FLOP/s of this machine with torch's default threads."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - start)


def model_flops_per_token(config, seq: int, reference: bool = False) -> float:
    h, L = config.hidden_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * config.intermediate_size
    n = L * per_layer + h * config.vocab_size  # + lm_head
    return 4 * n + 12 * L * h * seq + ((2 * n + 4 * L * h * seq) if reference else 0)


def bench_one(
    model_dir: Path, method: str, ckpt: bool, args: argparse.Namespace, objective: str = "sft"
) -> dict:
    dpo = objective == "dpo"
    per_step = args.batch // 2 if dpo else args.batch  # pairs (two sequences each) or examples
    spec = JobSpec(
        objective=objective,
        base_model="bench",
        dataset_id="benchmark01",
        method=method,
        gradient_checkpointing=ckpt,
        micro_batch_size=per_step,
        gradient_accumulation_steps=1,
        max_seq_len=args.seq_len,
        lora_r=16,
        lora_dropout=0.0,
        max_steps=args.steps + 2,
    )
    torch.manual_seed(0)
    model = load_model(spec, model_dir, torch.device("cpu"))
    params = [p for _, p in trainable_parameters(model)]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 3000, (args.batch * (args.steps + 2), args.seq_len), generator=gen).tolist()
    items: list = [Tokenized(row, row) for row in ids]
    step_fn = train_step
    if dpo:  # pairs of two rows sharing a prompt: a quarter prompt, then two different replies
        cut = args.seq_len // 4
        items = [
            Pair(
                Tokenized(a, [-100] * cut + a[cut:]),
                Tokenized(a[:cut] + b[cut:], [-100] * cut + b[cut:]),
                cut,
            )
            for a, b in zip(ids[0::2], ids[1::2], strict=True)
        ]
        step_fn = dpo_train_step  # type: ignore[assignment]
    parts = Parts(spec, model, make_optimizer(spec, params), params, torch.device("cpu"))
    steps = iter([[i] for i in range(k * per_step, (k + 1) * per_step)] for k in range(args.steps + 2))
    tracker = PeakMemory(torch.device("cpu"), measured_steps=1)
    model.train()
    step_fn(parts, items, 0, next(steps), lr=spec.learning_rate)  # warm-up: allocations, optimizer states
    with tracker.step(model_state_tensors(model, parts.optimizer)):
        step_fn(parts, items, 0, next(steps), lr=spec.learning_rate)
    start = time.perf_counter()
    for _ in range(args.steps):
        step_fn(parts, items, 0, next(steps), lr=spec.learning_rate)
    seconds = (time.perf_counter() - start) / args.steps
    tokens = args.batch * args.seq_len
    return {
        "tok_s": tokens / seconds,
        "step_s": seconds,
        "peak": tracker.peak_bytes,
        "flops": model_flops_per_token(model.config, args.seq_len, reference=dpo) * tokens / seconds,
        "trainable": sum(p.numel() for p in params),
        "params": sum(_logical_numel(p) for p in model.parameters() if not p.requires_grad),
    }


def _logical_numel(p: torch.Tensor) -> int:
    qs = getattr(p, "quant_state", None)  # a 4-bit weight packs two values per byte
    return qs.shape.numel() if qs is not None else p.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per row")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--models", nargs="*", default=list(SIZES))
    parser.add_argument("--objectives", nargs="*", default=["sft", "dpo"], choices=["sft", "dpo"])
    args = parser.parse_args()

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")  # peft uses old names
    peak_flops = matmul_flops()
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, fp32 matmul {peak_flops / 1e9:.1f} GFLOP/s")
    print(
        f"micro-batch {args.batch} x {args.seq_len} tokens (dpo: {args.batch // 2} pairs), "
        f"{args.steps} timed steps per row\n"
    )
    header = (
        f"{'model':<10} {'method':<6} {'ckpt':<4} {'obj':<4} {'params':>7} {'tok/s':>8} {'s/step':>7}"
        f" {'peak MiB':>9} {'GFLOP/s':>8} {'mm GF/s':>8} {'of peak':>7}"
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model_dir = build_demo_model(Path(tmp), name=name, size=SIZES[name])
            for method in ("lora", "qlora"):
                for ckpt in (False, True):
                    for objective in args.objectives:
                        # The machine may be shared: take the matmul peak next to each row, not once.
                        before = matmul_flops(seconds=0.5)
                        r = bench_one(model_dir, method, ckpt, args, objective)
                        peak_flops = max(before, matmul_flops(seconds=0.5))
                        print(
                            f"{name:<10} {method:<6} {'on' if ckpt else 'off':<4} {objective:<4}"
                            f" {r['params'] / 1e6:>6.1f}M {r['tok_s']:>8.0f} {r['step_s']:>7.2f}"
                            f" {r['peak'] / 2**20:>9.1f} {r['flops'] / 1e9:>8.1f} {peak_flops / 1e9:>8.1f}"
                            f" {r['flops'] / peak_flops:>7.1%}",
                            flush=True,
                        )
    print("\nof peak: model FLOP/s / max(fp32 matmul FLOP/s measured just before and just after the row)")


if __name__ == "__main__":
    main()
