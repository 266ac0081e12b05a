"""Planner vs published peak GPU memory: `python bench/planner_accuracy.py [--verbose]`.

Cases (bench/planner_cases.json) are measured peaks from public sources, each with its citation;
architectures come from config dicts written by hand from the models' public config.json. The
planner is run unchanged (no per-row fitting); a case states only what its source's framework did
(`runtime`: core.planner.Runtime fields, e.g. peft's fp32 upcast for QLoRA) and what its number measures
(`measures`: capacity | device | reserved | allocated, see predicted_bytes; `lengths`: padded | variable,
the batches it measured over), each with the evidence or assumption in its `note`. Prints prediction vs
measurement per case, the error, the median absolute error, and how long a plan with suggestions takes.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.arch import from_config
from core.planner import Runtime, estimate
from core.planner.gpus import resolve_gpu
from core.spec import JobSpec

GiB = 2**30
CASES = Path(__file__).with_name("planner_cases.json")


def run(verbose: bool = False) -> float:
    data = json.loads(CASES.read_text())
    archs = {name: from_config(m["config"]) for name, m in data["models"].items()}
    errors: list[float] = []
    by_source: dict[str, list[float]] = {}
    print(f"{'case':58} {'pred GiB':>9} {'meas GiB':>9} {'err %':>7}")
    for case in data["cases"]:
        spec = JobSpec(
            base_model="bench",
            dataset_id="benchcase",
            method=case["method"],
            micro_batch_size=case["micro_batch"],
            max_seq_len=case["seq_len"],
            gradient_checkpointing=case["checkpointing"],
            optimizer=case["optimizer"],
            lora_r=case["lora_r"],
            lora_target_modules=case["targets"],
            lora_dropout=case["lora_dropout"],
            attn_implementation=case["attn"],
            num_gpus=case["num_gpus"],
        )
        runtime = Runtime(**case.get("runtime", {}))
        plan = estimate(spec, archs[case["model"]], resolve_gpu(case["gpu"]), suggest=False, runtime=runtime)
        pred = predicted_bytes(plan, case.get("measures", "device"), case.get("lengths", "padded")) / GiB
        err = 100 * (pred - case["measured_gib"]) / case["measured_gib"]
        errors.append(err)
        by_source.setdefault(case["id"].split("/")[0], []).append(abs(err))
        print(f"{case['id']:58} {pred:9.2f} {case['measured_gib']:9.2f} {err:+7.1f}")
        if verbose:
            for t in plan.breakdown:
                if t.bytes:
                    print(f"      {t.bytes / GiB:7.2f}  {t.name}")
    med = statistics.median(abs(e) for e in errors)
    print(
        f"\n{len(errors)} cases; median absolute error {med:.1f}%; mean signed error "
        f"{statistics.mean(errors):+.1f}%; within 10%: {sum(abs(e) <= 10 for e in errors)}/{len(errors)}"
    )
    for source, errs in by_source.items():
        print(f"  {source:12} n={len(errs):2}  median |err| {statistics.median(errs):5.1f}%")
    _timing(archs["llama-3.1-8b"])
    return med


def predicted_bytes(plan, measures: str, lengths: str = "padded") -> int:
    """The part of the plan a source's number measures. "capacity" (the GPU size a run just fit in) is the
    whole plan: cached free blocks are released and the allocation retried before an OOM, so they do not
    count. "device" (nvidia-smi) adds the cached blocks a run keeps reserved: the loss buffers' segments
    (Plan.loss_segments_bytes) and, over batches of varying length ("lengths": "variable"), the blocks left
    by earlier, shorter batches (Plan.varlen_cache_bytes). "reserved" (torch.cuda.max_memory_reserved) is
    that without the CUDA context, which lives outside torch's allocator. "allocated"
    (max_memory_allocated) is the plan without context and allocator margin."""
    if measures == "allocated":
        return plan.allocated_bytes
    if measures == "capacity":
        return plan.total_bytes
    cached = plan.loss_segments_bytes + (plan.varlen_cache_bytes if lengths == "variable" else 0)
    context = sum(t.bytes for t in plan.breakdown if t.name == "CUDA context")
    return plan.total_bytes + cached - (context if measures == "reserved" else 0)


def _timing(arch) -> None:
    spec = JobSpec(base_model="bench", dataset_id="benchcase", micro_batch_size=16, max_seq_len=4096)
    gpu = resolve_gpu("24GB")
    start = time.perf_counter()
    n = 20
    for _ in range(n):
        plan = estimate(spec, arch, gpu, tokens_per_epoch=10_000_000)
    ms = (time.perf_counter() - start) / n * 1000
    print(f"\nplan + {len(plan.suggestions)} suggestions for a job that does not fit: {ms:.1f} ms")


if __name__ == "__main__":
    run(verbose="--verbose" in sys.argv)
