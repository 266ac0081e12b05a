"""The planner's allocated and reserved bytes vs PyTorch's CUDA caching allocator replayed on traced steps,
on a CPU: the gpu_check configs without a GPU.

    .venv/bin/python bench/planner_allocator.py [--configs lora,qlora] [--layers 22] [--steps 8]

Each config (bench/gpu_check.py's: the 1.1B Llama shape, alpaca_small packed 4 x 1024, micro-batches of
2,233-4,076 tokens over 8 steps) runs the engine's own code (training.loss's chunked head,
training.packing's attention, training.dropout's masks, peft and bitsandbytes' layers, non-reentrant
checkpointing, foreach AdamW) on fake tensors (torch._subclasses.FakeTensorMode: shapes only, no compute, no
memory), with the engine's CUDA branches taken (bf16 autocast, the varlen flash kernel, bool dropout masks,
bitsandbytes' dequantize-then-matmul above 1,536 rows) and the CUDA kernels' own buffers added (flash
attention's backward accumulators). Every tensor storage's birth and death is recorded in order, then
replayed through a re-implementation of c10/cuda/CUDACachingAllocator.cpp's rules: 512 B rounding, best fit
by size and address, free neighbours merged, nothing returned; by default with expandable segments, as
training.run sets them (one segment per pool, 20 MiB pages in the large pool and 2 MiB in the small one
mapped at its end when no cached block fits, every split kept), with --classic torch's default segments (2
MiB ones for requests up to 1 MiB, 20 MiB ones up to 10 MiB, larger ones rounded to 2 MiB; a block split
when more than 1 MiB (small pool: 512 B) is left). The weights are loaded first (QLoRA: each linear's bf16
weight and fp32 absmax made and freed as it is quantized). The replay's max allocated and max reserved are
what torch.cuda reports, plus the cuBLAS workspaces the trace does not see (in the plan; so is the CUDA
context, outside the allocator).

Checked against one H200 (torch 2.11, whose varlen attention has no enable_gqa: --no-gqa;
bench/results/h200-2026-11-26, run 2): replayed allocated and reserved 16.01 / 16.36 GiB (lora),
5.39 / 5.52 (lora+ckpt), 1.62 / 1.81 (qlora), 10.94 / 11.27 (qlora-no-ckpt) vs measured 16.01 / 16.32,
5.39 / 5.54, 1.62 / 1.81, 10.94 / 11.29: within 0.3%. An earlier version of this trace, of the
engine before its chunked head and varlen attention, replayed with torch's default segments, matched that
engine's H200 peaks within 2.5% (allocated 15.43 / 5.37 / 1.60 / 10.37 GiB and reserved 16.51 / 5.60 / 2.10 /
15.47 for lora, lora+ckpt, qlora, qlora-no-ckpt vs 15.43 / 5.37 / 1.62 / 10.39 and 16.49 / 5.60 / 2.08 /
15.50), QLoRA's 5.1 GiB of fragmentation without checkpointing included.
Prints, per config: the plan admission makes (micro_batch_size x max_seq_len tokens), the engine's plan from
its data's largest micro-batch, and the replay, with the signed errors of the plan's allocated and reserved,
and of its total (reserved + the CUDA context) against the replay's reserved.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import gpu_check  # noqa: E402  # the configs' model shape and their job settings
from allocator_rules import GiB, replay  # noqa: E402
from allocator_trace import micro_batches, take_cuda_paths, trace  # noqa: E402

SHAPE = gpu_check.SHAPE
# gpu_check's single-GPU configs (a replay of one process has no FSDP), and LoRA on bf16 base weights (as
# bench/gpu_vs_trl.py trains): its q/k/v and gate/up read one bf16 input each (Runtime.lora_input_cast)
CONFIGS: dict[str, dict[str, Any]] = {k: v for k, v in gpu_check.CONFIGS.items() if not v.get("fsdp")}
CONFIGS["lora-bf16"] = {"method": "lora", "torch_dtype": "bfloat16", "lora_dropout": 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--layers", type=int, default=SHAPE["num_layers"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--gpu", default="H200", help="the GPU the plans are made for")
    parser.add_argument(
        "--no-gqa",
        action="store_true",
        help="torch's varlen attention without enable_gqa (before 2.12): k and v repeated",
    )
    parser.add_argument(
        "--classic",
        action="store_true",
        help="replay without expandable segments (PYTORCH_CUDA_ALLOC_CONF set otherwise)",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from core.arch import from_config
    from core.spec import JobSpec
    from planner import BatchShape
    from planner.allocator import workspace_terms
    from planner.context import plan_context
    from planner.feasibility import plan_on
    from planner.gpus import resolve_gpu
    from planner.types import FTUNE
    from training.demo import DemoSize, build_demo_model

    take_cuda_paths(gqa=not args.no_gqa)
    gpu = resolve_gpu(args.gpu)
    vocab = DemoSize().vocab_size
    arch = from_config(
        {
            "model_type": "llama",
            "hidden_size": SHAPE["hidden_size"],
            "num_hidden_layers": args.layers,
            "num_attention_heads": SHAPE["num_heads"],
            "num_key_value_heads": SHAPE["num_kv_heads"],
            "intermediate_size": SHAPE["intermediate_size"],
            "vocab_size": vocab,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }
    )
    print(
        f"{'config':14} {'plan':5} {'allocated':>9} {'replay':>7} {'error':>7} {'reserved':>9} {'replay':>7} "
        f"{'error':>7} {'total':>7} {'vs resv':>7}   s"
    )
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_demo_model(
            Path(tmp),
            name="tokenizer",
            size=DemoSize(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=128),
        )
        for name in args.configs.split(","):
            spec = JobSpec(
                base_model="gpu-check-1b",
                dataset_id="gpucheck01",
                max_steps=args.steps,
                max_seq_len=1024,
                micro_batch_size=4,
                checkpoint_every_steps=0,
                packing=True,
                **CONFIGS[name],
            )
            began = time.monotonic()
            data = micro_batches(spec, args.steps, tok)
            tracer = trace(spec, data, args.layers)
            a = replay(tracer.events, expandable=not args.classic)
            # what the GPU adds inside the allocator that the trace does not see
            cublas = sum(t.bytes for t in workspace_terms(plan_context(spec, arch, gpu, FTUNE), gpu.name))
            measured = (a.peak_allocated + cublas, a.peak_reserved + cublas)
            tokens = max(int(b["input_ids"].numel()) for mbs in data for b in mbs)
            scored = max(len(b["target_labels"]) for mbs in data for b in mbs)
            widest = max(b["max_length_q"] for mbs in data for b in mbs)
            shape = BatchShape(tokens=tokens, seq_len=widest, targets=scored)
            for label, plan in (
                ("plan", plan_on(spec, arch, gpu)),
                ("data", plan_on(spec, arch, gpu, shape=shape)),
            ):
                alloc, resv = measured
                print(
                    f"{name:14} {label:5} {plan.allocated_bytes / GiB:9.2f} {alloc / GiB:7.2f} "
                    f"{(plan.allocated_bytes - alloc) / alloc:+7.1%} {plan.reserved_bytes / GiB:9.2f} "
                    f"{resv / GiB:7.2f} {(plan.reserved_bytes - resv) / resv:+7.1%} "
                    f"{plan.total_bytes / GiB:7.2f} {(plan.total_bytes - resv) / resv:+7.1%}   "
                    f"{time.monotonic() - began:.0f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
