"""Before a GPU session's long benches: does every kind of job run on this machine's device? (~1 minute)

    python bench/gpu_preflight.py [--keep DIR] [--only NAME ...]

Each case is one `python -m training.run` process, as a worker runs a job, on the tiny demo model (2 layers
of width 64), 2 optimizer steps, and must end with its adapter: the engine's device-only lines (CUDA's peak
statistics, the fused layers, the varlen attention, bitsandbytes' 4-bit layers, the rollouts' sampling)
each run once, so that an error there costs a GPU session seconds instead of every bench it runs
(2026-11-27, H200: each job of a 7-minute call failed at its first CUDA line). Prints a line per case and
exits 1 if any failed. Where there is no GPU it runs the same cases on the CPU (its smoke test).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.run_protocol import RunConfig  # noqa: E402
from core.spec import JobSpec  # noqa: E402
from training import run  # noqa: E402
from training.demo import TINY, build_demo_model  # noqa: E402

EXAMPLES = ROOT / "examples"
GRADER = {"type": "string_check", "name": "exact", "operation": "eq"}
GRADER |= {"input": "{{sample.output_text}}", "reference": "{{item.answer}}"}
# name: (spec fields, dataset)
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "sft lora, packed": ({}, "alpaca_small.jsonl"),
    "sft lora, padded, checkpointing": (
        {"packing": False, "gradient_checkpointing": True},
        "alpaca_small.jsonl",
    ),
    "sft lora, bf16 weights": ({"torch_dtype": "bfloat16", "lora_dropout": 0.0}, "alpaca_small.jsonl"),
    "sft qlora": ({"method": "qlora"}, "alpaca_small.jsonl"),
    "dpo": ({"objective": "dpo"}, "preference_small.jsonl"),
    "grpo": (
        {"objective": "grpo", "grader": GRADER, "num_generations": 4, "max_completion_tokens": 16},
        "rft_small.jsonl",
    ),
}


def start(name: str, model: Path, out: Path) -> subprocess.Popen[str]:
    """One case's training process, started, writing to `out`."""
    fields, dataset = CASES[name]
    spec = JobSpec(
        base_model="preflight-tiny", dataset_id="preflight01", max_steps=2, max_seq_len=256,
        micro_batch_size=2, checkpoint_every_steps=1, **fields,
    )  # fmt: skip
    config = RunConfig(
        job_id=out.name,
        spec=spec,
        model_dir=str(model),
        dataset_path=str(EXAMPLES / dataset),
        output_dir=str(out),
    )
    path = out.parent / f"{out.name}.json"
    path.write_text(config.model_dump_json())
    command = [sys.executable, "-m", run.__name__, str(path)]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def verdict(name: str, process: subprocess.Popen[str], out: Path) -> tuple[bool, str]:
    """Whether the case ran its 2 steps to an adapter; (ok, what to print)."""
    output, _ = process.communicate()
    metrics = out / "metrics.jsonl"
    records = metrics.read_text().splitlines() if metrics.exists() else []
    steps = [r for r in map(json.loads, records) if r.get("type") == "step"]
    adapter = (out / "adapter" / "adapter_model.safetensors").exists()
    if process.returncode == 0 and len(steps) == 2 and adapter:
        return True, f"ok    {name:34} loss {steps[-1]['loss']:.3f}"
    tail = "\n      ".join(output.strip().splitlines()[-15:])
    return (
        False,
        f"FAIL  {name:34} exit {process.returncode}, {len(steps)} steps, adapter {adapter}\n      {tail}",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", type=Path, help="work directory (default: a temporary one)")
    parser.add_argument("--only", nargs="+", choices=list(CASES), help="these cases alone")
    args = parser.parse_args()
    import torch

    work = args.keep or Path(tempfile.mkdtemp(prefix="gpu-preflight-"))
    work.mkdir(parents=True, exist_ok=True)
    model = build_demo_model(work / "models", name="preflight-tiny", size=TINY)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU: the CPU"
    print(f"gpu_preflight on {device}", flush=True)
    names = args.only or list(CASES)
    started = time.monotonic()
    # all at once: each is mostly its process's start (imports, CUDA's context), and the GPU has room
    outs = {name: work / name.replace(" ", "_").replace(",", "") for name in names}
    processes = {name: start(name, model, outs[name]) for name in names}
    failed = 0
    for name, process in processes.items():
        ok, line = verdict(name, process, outs[name])
        failed += not ok
        print(line, flush=True)
    print(f"gpu_preflight: {len(names) - failed} ok, {failed} failed in {time.monotonic() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
