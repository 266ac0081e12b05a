"""Objective grpo on a CUDA GPU: it runs, how its step splits into sampling / grading / training, and the
planner against the allocator, for a few configs of bench/gpu_check.py's 1.1B Llama shape (random weights).

    python bench/gpu_grpo.py [--steps 4] [--keep DIR] [--models DIR]

Each config is one `python -m training.run` process (as a worker runs a job) of an exact-match
string_check grader on synthetic prompts; printed side by side: the plan's allocated and reserved peaks (the
start record) against max_memory_allocated and max_memory_reserved (the step records), and the mean seconds
of each phase from step 2 on.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_check import build_model  # noqa: E402
from core.run_protocol import RunConfig  # noqa: E402
from core.spec import JobSpec  # noqa: E402
from training import run  # noqa: E402

GRADER = {"type": "string_check", "name": "exact", "operation": "eq"}
GRADER |= {"input": "{{sample.output_text}}", "reference": "{{item.answer}}"}
CONFIGS: list[dict[str, Any]] = [
    {"name": "lora mb2 x g8, 512 = 384 + 128", "micro_batch_size": 2, "num_generations": 8},
    # a step's 4 prompts sampled in one generate() call (before 2026-11-27: two calls, one per micro-batch):
    # its sampling time against the line above's (2 prompts, one call) says how host-bound decoding is
    {"name": "lora mb2 x g8 x accumulation 2", "micro_batch_size": 2, "num_generations": 8,
     "gradient_accumulation_steps": 2},
    {"name": "lora mb2 x g8, beta 0.04", "micro_batch_size": 2, "num_generations": 8, "beta": 0.04},
    {"name": "lora mb4 x g8, checkpointing", "micro_batch_size": 4, "num_generations": 8,
     "gradient_checkpointing": True},
]  # fmt: skip


def prompts(path: Path, n: int) -> Path:
    words = ["alpha", "bravo", "charlie", "delta", "echo"]
    rows = [
        {"messages": [{"role": "user", "content": f"Repeat the word {words[i % 5]} " + "please " * (i % 40)}],
         "answer": words[i % 5]}
        for i in range(n)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def one(model: Path, data: Path, out: Path, steps: int, config: dict[str, Any]) -> dict[str, Any]:
    fields = {k: v for k, v in config.items() if k != "name"}
    spec = JobSpec(
        base_model="gpu-check-1b", dataset_id="benchdata01", objective="grpo", grader=GRADER, max_steps=steps,
        max_seq_len=512, max_completion_tokens=128, lora_r=16, lora_dropout=0.0, checkpoint_every_steps=0,
        temperature=1.0, **fields,
    )  # fmt: skip
    # Its own process, as a worker runs a job: CUDA's peak statistics are per process, so configs run one
    # after another in this one would each report the highest peak so far.
    config_json = out.parent / f"{out.name}.json"
    config_json.write_text(
        RunConfig(
            job_id="grpo", spec=spec, model_dir=str(model), dataset_path=str(data), output_dir=str(out)
        ).model_dump_json()
    )
    rc = subprocess.run([sys.executable, "-m", run.__name__, str(config_json)], cwd=ROOT).returncode
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["type"] == "start")
    steps_ = [r for r in records if r["type"] == "step"]
    later = steps_[1:] or steps_
    timing = {
        k: sum(r["rl"]["timing"][k] for r in later) / len(later) for k in ("sampling", "grading", "training")
    }
    return {
        "config": config["name"],
        "rc": rc,
        "planned_allocated_GiB": start["predicted_peak_bytes"] / 2**30,
        "planned_reserved_GiB": (start["predicted_reserved_bytes"] or 0) / 2**30,
        "max_allocated_GiB": max(r["peak_mem_bytes"] or 0 for r in steps_) / 2**30,
        "max_reserved_GiB": max(r["peak_reserved_bytes"] or 0 for r in steps_) / 2**30,
        "seconds": timing,
        "completion_tokens_mean": sum(r["rl"]["completion_tokens_mean"] for r in steps_) / len(steps_),
        "reward_mean": [r["rl"]["reward_mean"] for r in steps_],
    }


def peak_phases(model_dir: Path, data: Path, micro: int, generations: int) -> dict[str, Any]:
    """Where a grpo step's CUDA peak comes from: max_memory_allocated (GiB) after loading (and what the
    weights hold), and the rollouts' own peak from a reset, to set beside a whole run's."""
    import torch

    from training import model as model_lib
    from training.rollouts import load_for_training, sample

    spec = JobSpec(
        base_model="gpu-check-1b", dataset_id="benchdata01", objective="grpo", grader=GRADER, max_steps=1,
        max_seq_len=512, max_completion_tokens=128, lora_r=16, lora_dropout=0.0,
        micro_batch_size=micro, num_generations=generations,
    )  # fmt: skip
    device = torch.device("cuda")
    tokenizer = model_lib.load_tokenizer(model_dir)
    net = model_lib.load_model(spec, model_dir, device)
    model_lib.use_cuda_paths(net, device, autocast=True)  # as training.recipe does
    items, _, _ = load_for_training(data, tokenizer, spec, None)
    gib = 2**30
    out: dict[str, Any] = {"dtype": str(next(net.parameters()).dtype)}
    out |= {"loaded": torch.cuda.max_memory_allocated() / gib, "weights": torch.cuda.memory_allocated() / gib}
    precision = model_lib.precision_for(spec, device, True)
    torch.cuda.reset_peak_memory_stats()
    with precision.autocast():
        sample(
            net, tokenizer, [p.input_ids for p in items[:micro]], n=generations, temperature=1.0,
            max_new_tokens=128, seed=(1, 1), device=device, chunk=micro,
        )  # fmt: skip
    out["rollouts"] = torch.cuda.max_memory_allocated() / gib
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--keep", type=Path)
    parser.add_argument("--models", type=Path, help="where gpu_check.py built its model (else built here)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--phases", action="store_true", help="only where the peak comes from (CUDA)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="gpu-grpo-"))
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(args.models or work / "models")
    data = prompts(work / "prompts.jsonl", 64)
    if args.phases:
        for micro in (2, 4):
            print(f"mb{micro} x g8 phases (GiB):", peak_phases(model, data, micro, 8), flush=True)
        return 0
    results = []
    for i, config in enumerate(CONFIGS):
        r = one(model, data, work / f"run{i}", args.steps, config)
        results.append(r)
        plan_a, got_a = r["planned_allocated_GiB"], r["max_allocated_GiB"]
        plan_r, got_r = r["planned_reserved_GiB"], r["max_reserved_GiB"]
        s = r["seconds"]
        alloc = f"allocated plan {plan_a:6.2f} GiB vs {got_a:6.2f} ({(plan_a / got_a - 1) * 100:+.1f}%)"
        reserved = f"reserved plan {plan_r:6.2f} vs {got_r:6.2f} ({(plan_r / got_r - 1) * 100:+.1f}%)"
        phases = (
            f"s/step sampling {s['sampling']:.2f} grading {s['grading']:.3f} training {s['training']:.2f}"
        )
        print(
            f"{r['config']:34} rc {r['rc']}  {alloc}  {reserved}  {phases}  "
            f"completion {r['completion_tokens_mean']:.0f} tok",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
