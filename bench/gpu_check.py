"""One command for the day a CUDA machine is at hand: the planner and the engine against real GPUs.

    .venv/bin/python bench/gpu_check.py [--steps 8] [--seq 1024] [--keep DIR]

Builds a ~1.1B-parameter Llama-shaped model locally (random weights, the demo tokenizer, no download),
then runs short jobs through the real engine (`training.run`, torchrun for FSDP): LoRA, QLoRA, LoRA with
gradient checkpointing off and on, and LoRA with FSDP over all GPUs. Per config it prints the plan
(core.planner, on the GPU found) beside torch.cuda.max_memory_allocated / max_memory_reserved (read in
the training process after it ends, rank 0 for FSDP), tokens/s and MFU (6 x parameters x tokens/s over
the GPU's dense bf16 peak: the usual estimate, a little high for LoRA, whose frozen weights get no
weight gradients).

Memory, per config, two lines: `plan` is core.planner's plan for the job as admission makes it (every
micro-batch micro_batch_size x max_seq_len tokens, all scored), `data` the engine's own prediction for its
data's largest micro-batch (the start record's shape, the engine's runtime). Each gives allocated (vs
max_memory_allocated), reserved (the plan's total less the CUDA context, vs max_memory_reserved) and the
total (vs max_memory_reserved, and vs the device memory in use when the process ends, its CUDA context
included: what the total stands for), with the signed errors (plan - measured) / measured. Issue 21's goal:
the total within 10% of max_memory_reserved and never under it by more than 5%, allocated never under
max_memory_allocated (with a context of ~0.75 GiB, a total within 10% of reserved alone is out of reach
for jobs under ~7.5 GiB: compare reserved with reserved, and the total with the device's used bytes).

Without CUDA it says so and exits 0 (nothing here can be measured on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# ~1.1B parameters (TinyLlama's shape), vocabulary of the demo tokenizer.
SHAPE = {"hidden_size": 2048, "num_layers": 22, "num_heads": 32, "num_kv_heads": 4, "intermediate_size": 5632}
CONFIGS: dict[str, dict[str, Any]] = {
    "lora": {"method": "lora", "gradient_checkpointing": False},
    "lora+ckpt": {"method": "lora", "gradient_checkpointing": True},
    "qlora": {"method": "qlora", "gradient_checkpointing": True},
    "qlora-no-ckpt": {"method": "qlora", "gradient_checkpointing": False},
    "lora-fsdp": {"method": "lora", "gradient_checkpointing": True, "fsdp": True},
}


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_entry(run_json: str) -> int:
    """Train in this process, then record the CUDA allocator's peaks (rank 0 writes them)."""
    import torch

    from training.run import main

    code = main([run_json])
    if os.environ.get("RANK", "0") == "0":
        out = Path(json.loads(Path(run_json).read_text())["output_dir"]) / "cuda_peaks.json"
        free, total = torch.cuda.mem_get_info()
        peaks = {
            "allocated": torch.cuda.max_memory_allocated(),
            "reserved": torch.cuda.max_memory_reserved(),
            "device_used": total - free,  # this process's context + its cached segments (+ anything else)
        }
        out.write_text(json.dumps(peaks))
    return code


def build_model(models_dir: Path) -> Path:
    from training.demo import DemoSize, build_demo_model

    size = DemoSize(vocab_size=DemoSize().vocab_size, max_position_embeddings=4096, **SHAPE)
    return build_demo_model(models_dir, name="gpu-check-1b", size=size)


def run_config(
    name: str, extra: dict[str, Any], model: Path, work: Path, steps: int, seq: int, gpus: int
) -> dict:  # type: ignore[type-arg]
    import torch

    from core.arch import load_architecture
    from core.planner import BatchShape
    from core.planner.feasibility import plan_on
    from core.planner.gpus import resolve_gpu
    from core.run_protocol import RunConfig, StartRecord, StepRecord, read_records
    from core.spec import JobSpec
    from training.memory import engine_runtime

    fsdp = bool(extra.pop("fsdp", False))
    n = gpus if fsdp else 1
    spec = JobSpec(
        base_model="gpu-check-1b",
        dataset_id="gpucheck01",
        max_steps=steps,
        max_seq_len=seq,
        micro_batch_size=4,
        checkpoint_every_steps=0,
        num_gpus=n,
        packing=True,
        **extra,
    )
    out = work / name
    config = RunConfig(
        job_id=name.replace("+", "-"),
        spec=spec,
        model_dir=str(model),
        dataset_path=str(ROOT / "examples" / "alpaca_small.jsonl"),
        output_dir=str(out),
    )
    out.mkdir(parents=True, exist_ok=True)
    run_json = out / "run.json"
    run_json.write_text(config.model_dump_json())
    me = [str(Path(__file__).resolve()), "--rank-entry", str(run_json)]
    if n == 1:
        cmd = [sys.executable, *me]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *me]
    code = subprocess.run(cmd, cwd=ROOT).returncode
    gpu = gpu_by_name(torch.cuda.get_device_name(0))
    if gpu is None:
        gpu = resolve_gpu(f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f}GB")
    arch = load_architecture(model)
    plan = plan_on(spec, arch, gpu)
    records = read_records(out / "metrics.jsonl")
    steps_done = [r for r in records if isinstance(r, StepRecord)]
    start = next((r for r in records if isinstance(r, StartRecord)), None)
    shape = BatchShape.from_token_stats(start.token_stats) if start else None
    data = plan_on(spec, arch, gpu, shape=shape, runtime=engine_runtime()) if shape else None
    tps = steps_done[-1].tokens_per_s if steps_done else None
    peaks = json.loads((out / "cuda_peaks.json").read_text()) if (out / "cuda_peaks.json").exists() else {}
    mfu = (6 * plan.total_params * tps / n / gpu.bf16_flops) if tps and gpu.bf16_flops else None
    g = 2**30
    return {
        "config": name,
        "exit": code,
        "gpus": n,
        "plan_allocated_gib": plan.allocated_bytes / g,
        "plan_reserved_gib": plan.reserved_bytes / g,
        "plan_total_gib": plan.total_bytes / g,
        "data_allocated_gib": data.allocated_bytes / g if data else None,
        "data_reserved_gib": data.reserved_bytes / g if data else None,
        "data_total_gib": data.total_bytes / g if data else None,
        "data_shape": shape.token_stats() if shape else None,
        "max_allocated_gib": peaks.get("allocated", 0) / g or None,
        "max_reserved_gib": peaks.get("reserved", 0) / g or None,
        "device_used_gib": peaks.get("device_used", 0) / g or None,
        # the engine's own records (training.memory: rank 0's tracker over the measured steps)
        "recorded_allocated_gib": max((r.peak_mem_bytes or 0 for r in steps_done), default=0) / g or None,
        "recorded_reserved_gib": max((r.peak_reserved_bytes or 0 for r in steps_done), default=0) / g or None,
        "tokens_per_s": tps,
        "mfu": mfu,
    }


def _err(plan: float | None, measured: float | None) -> str:
    return f"{(plan - measured) / measured:+7.1%}" if plan and measured else "      -"


def memory_lines(row: dict) -> list[str]:  # type: ignore[type-arg]
    """The two memory lines of a config: the admission plan and the engine's data-aware one."""
    alloc, resv, used = row["max_allocated_gib"], row["max_reserved_gib"], row["device_used_gib"]
    lines = []
    for label, key in (("plan", "plan"), ("data", "data")):
        a, r, t = row[f"{key}_allocated_gib"], row[f"{key}_reserved_gib"], row[f"{key}_total_gib"]
        lines.append(
            f"  {label:4} allocated {_fmt(a, '6.2f')} vs {_fmt(alloc, '6.2f')} {_err(a, alloc)} | "
            f"reserved {_fmt(r, '6.2f')} vs {_fmt(resv, '6.2f')} {_err(r, resv)} | "
            f"total {_fmt(t, '6.2f')} vs reserved {_err(t, resv)}, vs device used {_fmt(used, '6.2f')} "
            f"{_err(t, used)}"
        )
    return lines


def _fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-".rjust(int(spec.split(".")[0]))


def gpu_by_name(name: str):  # -> core.planner.gpus.Gpu | None
    """The planner's GPU of this CUDA name, or None. CUDA's names carry words the planner's do not
    ("NVIDIA H100 80GB HBM3"): trailing words are dropped until a name resolves ("NVIDIA H100 80GB")."""
    from core.errors import InvalidInput
    from core.planner.gpus import resolve_gpu

    words = name.split()
    for n in range(len(words), 0, -1):
        try:
            return resolve_gpu(" ".join(words[:n]))
        except InvalidInput:
            continue
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--keep", type=Path, help="work directory (default: a temporary one)")
    parser.add_argument("--rank-entry", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_entry:
        return rank_entry(args.rank_entry)
    gpus = cuda_devices()
    if gpus == 0:
        print(
            "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to measure. "
            "Run it on a machine with NVIDIA GPUs and a CUDA build of torch."
        )
        return 0
    work = args.keep or Path(tempfile.mkdtemp(prefix="ftune-gpu-check-"))
    model = build_model(work / "models")
    print(
        f"{'config':14} {'gpus':>4} {'plan alloc':>10} {'max alloc':>10} {'plan resv':>9} {'max resv':>9} "
        f"{'plan total':>10} {'tok/s':>8} {'MFU':>6}   (GiB; errors below: (plan - measured) / measured)"
    )
    rows = []
    for name, extra in CONFIGS.items():
        if extra.get("fsdp") and gpus < 2:
            print(f"{name:14} skipped: FSDP needs 2 or more GPUs, this machine has {gpus}")
            continue
        row = run_config(name, dict(extra), model, work, args.steps, args.seq, gpus)
        rows.append(row)
        cells = [
            _fmt(row[k], spec)
            for k, spec in (
                ("plan_allocated_gib", "10.2f"),
                ("max_allocated_gib", "10.2f"),
                ("plan_reserved_gib", "9.2f"),
                ("max_reserved_gib", "9.2f"),
                ("plan_total_gib", "10.2f"),
                ("tokens_per_s", "8.0f"),
                ("mfu", "6.1%"),
            )
        ]
        failed = "" if row["exit"] == 0 else f"  (exit {row['exit']})"
        print(f"{name:14} {row['gpus']:>4} {' '.join(cells)}{failed}", flush=True)
        print("\n".join(memory_lines(row)), flush=True)
    print(json.dumps(rows))
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
