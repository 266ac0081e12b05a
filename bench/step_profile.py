"""Where the engine's training step spends its time on the device found: bench/gpu_vs_trl.py's "ftune
packed" job (bench/sft_job.py: the 1.1B model, its rows and spec: micro-batch 8 x 1024 packed, LoRA r16,
bf16, no checkpointing) run through the recipe (training.recipe setup -> train) under torch.profiler, for
the numbers the MFU goal needs and a timing cannot give.

    python bench/step_profile.py [--steps 8] [--models DIR] [--eager-layers] [--compile fused] [--rows 25]

Prints the steps' wall time beside the device's busy time (the kernels' time summed: what a step would
take with no gap between kernels), that time by kind of kernel (matrix products, attention, the loss head,
elementwise and the rest, by kernel name), and the kernels that take the most. The engine's decoder layers
are compiled as it compiles them (training.compiled: on CUDA); --eager-layers: run eagerly (as
bench/gpu_vs_trl.py's "ftune eager"); --compile fused, with them, the engine's fused functions compiled
(as --compiled-fused). On a CPU (its smoke test) the smoke's tiny model and the CPU's operators stand in for
kernels.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import sft_job  # bench/, this script's own folder

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# a kernel's kind, by the first of these its name contains (lowercase); the rest is "other". Attention
# first: flash attention's kernels name cutlass in their template arguments. nvjet: cuBLAS' GEMM kernels
# on Hopper (an H200, 2026-11-28, counted them as "other" before)
KINDS = [
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matrix products", ("gemm", "xmma", "cutlass", "cublas", "nvjet", "matmul", "addmm", "mm")),
    ("loss head", ("cross_entropy", "log_softmax", "nll")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("elementwise", ("elementwise", "vectorized", "triton", "reduce", "copy", "fill", "cat")),
]


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, marks in KINDS if any(m in low for m in marks)), "other")


class Never:
    def is_set(self) -> bool:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps; 3 on are profiled")
    parser.add_argument("--models", type=Path, help="where gpu_check.py built its model (else built here)")
    parser.add_argument(
        "--compile",
        default="",
        choices=["", *sft_job.COMPILE_MODES],
        help="fused: the fused functions compiled",
    )
    parser.add_argument("--eager-layers", action="store_true", help="the decoder layers run eagerly")
    parser.add_argument("--rows", type=int, default=25, help="kernels listed")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be 3 or more (steps 1 and 2 are the warm-up)")

    import torch
    from torch.profiler import ProfilerActivity, profile

    from core.run_protocol import RunConfig
    from training import fused, recipe

    cuda = torch.cuda.is_available()
    work = Path(tempfile.mkdtemp(prefix="step-profile-"))
    setup = sft_job.gpu_setup(args.steps) if cuda else sft_job.smoke_setup(steps=args.steps)
    model = sft_job.build_model(args.models or work / "models", smoke=not cuda)
    data = sft_job.write_rows(work / "rows.jsonl", setup.rows, setup.median_words)
    spec = sft_job.job_spec(setup, True, model.name)
    config = RunConfig(job_id="profile", spec=spec, model_dir=str(model), dataset_path=str(data),
                       output_dir=str(work / "out"), compile_layers=not args.eager_layers)  # fmt: skip
    sft_job.prepare_engine(compiled=args.compile)
    state = recipe.setup(config, Never())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # steps 1-2 (the warm-up: cuBLAS' and the compiler's first calls) not profiled; each step's record
    # (the step has waited for the device by then) moves the profiler on and marks the time
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=args.steps - 2)
    marks: list[float] = []
    record = recipe.record_step

    def record_and_mark(*a: object, **kw: object) -> None:
        record(*a, **kw)
        marks.append(time.perf_counter())
        prof.step()

    recipe.record_step = record_and_mark  # type: ignore[assignment]
    with profile(activities=activities, schedule=schedule) as prof:
        recipe.train(state)
    steps = args.steps - 2
    wall = marks[-1] - marks[1]  # steps 3..N

    device_time = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, device_time) > 0 and e.key != "ProfilerStep*"]
    if cuda:  # kernels only: CPU-side operators report no device time of their own
        events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(getattr(e, device_time) for e in events)
    by_kind: dict[str, float] = defaultdict(float)
    for e in events:
        by_kind[kind(e.key)] += getattr(e, device_time)
    where = torch.cuda.get_device_name(0) if cuda else "CPU (smoke: not a measurement)"
    print(
        f"step_profile on {where}: {steps} steps, micro-batch {setup.micro_batch} x {setup.max_seq_len} "
        f"packed, layers {'eager' if args.eager_layers else 'as the engine compiles them'}, compiled: "
        f"{args.compile or 'nothing more'}; profiled: steps 3..{args.steps}"
    )
    print(
        f"wall {wall / steps * 1e3:8.1f} ms a step (profiled); device busy {busy_us / steps / 1e3:8.1f} ms "
        f"a step ({busy_us / 1e6 / wall:.0%} of the wall)"
    )
    for name, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {name:16} {us / steps / 1e3:8.2f} ms a step  {us / busy_us:6.1%}")
    print(f"\nthe {args.rows} kernels that take the most (ms a step, calls a step, kind):")
    for e in sorted(events, key=lambda e: -getattr(e, device_time))[: args.rows]:
        name = e.key if len(e.key) <= 90 else e.key[:87] + "..."
        ms = getattr(e, device_time) / steps / 1e3
        print(f"  {ms:8.2f} {e.count / steps:7.1f}  {kind(e.key):16} {name}")
    if args.compile == "fused":
        print(f"torch.compile failed on: {', '.join(fused.not_compiled()) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "bench"))
    raise SystemExit(main())
