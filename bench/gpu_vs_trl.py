"""ftune's engine against TRL's SFTTrainer on one GPU: the same model, data, LoRA, batch, precision and
gradient checkpointing, each run in a process of its own.

    python3 bench/gpu_vs_trl.py [--steps 30] [--checkpointing] [--compiled-fused] [--eager-layers]
                                [--keep DIR] [--models DIR] [--json-out FILE]

Builds (bench/sft_job.py) a ~1.1B-parameter Llama-shaped model (bench/gpu_check.py's shape and name: random
weights, the demo tokenizer, no download; --models reuses one gpu_check.py built) and 2,000 chat rows (a
user turn and an assistant reply, lognormal lengths, median ~120 words) as JSONL, then trains four runs of
N steps:

  ftune packed    the real engine: a RunConfig and `python -m training.run run.json` (through this file's
  ftune padded    --ftune-entry, which reads the CUDA allocator's peaks in the training process after it);
                  its decoder layers compiled for the training step where the engine compiles them
                  (training.compiled: on CUDA, here without checkpointing)
  trl packed      TRL's SFTTrainer (bench/trl_reference.py), packing=True (best-fit decreasing, padding-free)
  trl padded      TRL's SFTTrainer, padded micro-batches (transformers' length-grouped sampler, where it has
                  one: ftune's padded batches are length-grouped too)
  ftune eager     with --eager-layers, after the packed pair: ftune packed with its layers run eagerly
                  (RunConfig.compile_layers false: the worker's FTUNE_COMPILE_LAYERS=false)
  ftune jit       with --compiled-fused, after the packed pair: ftune eager, with the engine's fused
                  norms, gates and rotary embeddings compiled (training.fused, jit=True), not run eagerly
                  Each is an A/B for the engine's default on CUDA. No run's first step (where the layers
                  compile) is timed; below the table, what torch.compile made in each ftune run that
                  compiled (graphs, recompiles, graph breaks)

Both sides: LoRA r16 alpha 32 dropout 0 on all linear layers; base weights bf16 under bf16 autocast (the
LoRA weights fp32, peft's and ftune's default); micro-batch 8 x max_seq_len 1024 (packed: 8 rows of up to
1024 tokens, one flat row of up to 8192 tokens on both sides); AdamW (torch), lr 1e-4 decaying linearly,
no warmup, gradients clipped at 1.0; gradient checkpointing off (--checkpointing: on, non-reentrant, on
both sides); attention SDPA (--attn). TRL trains the very token ids and labels ftune does: the rows are
tokenized once by ftune's own code (training.data.load_for_training: chat template, loss on the reply)
and handed to TRL pre-tokenized (input_ids + labels), which it then packs or pads itself.

Measured per run over steps 2..N (step 1, the warmup, is left out):
  tok/s    real input tokens (padding never counted) per second of step time. ftune: its StepRecords
           (`tokens`; the step seconds summed in `elapsed_s`: each step is timed around training.step's
           train_step, which waits for the device when it reads the loss and the gradient norm). TRL: a
           TrainerCallback that calls torch.cuda.synchronize() at on_step_begin and on_step_end and
           times what lies between; the tokens of each micro-batch counted as it enters training_step
           (attention_mask.sum(); a padding-free row carries no padding: its length). "loop tok/s" (TRL):
           over the whole loop from the end of step 1 to the end of step N, data loading and logging
           included.
  MFU      6 x total parameters x tok/s / the GPU's dense bf16 peak (core.planner.gpus): the usual estimate,
           a little high for LoRA (frozen weights get no weight gradients), attention FLOPs not counted.
  memory   torch.cuda.max_memory_allocated / max_memory_reserved in the training process, after training.
  loss     the last step's loss (the same data and lr: the four should be close, not equal: different
           batches).

Attention under packing: ftune makes one attention call per layer for the whole packed batch
(training.packing: torch's varlen flash attention on CUDA). TRL's padding-free row
has no attention_mask, only position_ids that restart per example; under SDPA transformers 5 builds a
block-diagonal mask from them (masking_utils.find_packed_sequence_indices, used when no KV cache is
made: SFTTrainer passes use_cache=False): correct, but a T x T masked SDPA over the whole 8192-token
row. TRL's docs name FlashAttention for padding-free; flash-attn is not needed for correctness, and
`--attn flash_attention_2` runs both sides with it where it is installed.

Each run has a timeout (--run-timeout) and all runs a budget (--budget), so a stuck run cannot eat the
time of the others. Without CUDA, or with --smoke, the same four runs train a tiny model on 40 rows for 3
steps in fp32, all four at once (one thread each; ftune's CPU memory profiling off): a test of this script
(tests/e2e/test_gpu_vs_trl.py), not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import gpu_check  # noqa: E402  # its GPU lookup
from sft_job import Setup, build_model, gpu_setup, job_spec, prepare_engine, smoke_setup, write_rows  # noqa: E402
from trl_reference import cuda_peaks, outcome, speed, trl_entry, trl_row  # noqa: E402  # TRL's side

# -- the processes that train --------------------------------------------------------------------------------


def ftune_entry(run_json: str, compiled: str = "") -> int:
    """Train through the engine's own entry point in this process, then record the allocator's peaks and
    what torch.compile made. `compiled`: what this bench compiles in the engine (sft_job.prepare_engine)."""
    from training.run import main

    prepare_engine(compiled)
    code = main([run_json])
    out = Path(json.loads(Path(run_json).read_text())["output_dir"]) / "cuda_peaks.json"
    counts = compile_counts()
    out.write_text(json.dumps(cuda_peaks() | ({"compiled": counts} if counts["graphs"] else {})))
    return code


def compile_counts() -> dict[str, Any]:
    """What torch.compile made in this process: graphs, recompiles and graph breaks (with their first
    reasons): a compiled run's speed means little if its graphs broke or compiled again per batch."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(counters["recompiles"].values()),
        "graph_breaks": sum(breaks.values()),
        "break_reasons": [reason.splitlines()[0][:200] for reason in list(breaks)[:3]],
    }


class Process:
    """A training process in a session of its own, its output to `log_path`. Its session is killed
    whole on a timeout, and when this process gets SIGTERM (see `main`)."""

    live: set[Process] = set()

    def __init__(self, cmd: list[str], log_path: Path, threads: int | None = None) -> None:
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
        if threads:  # processes side by side on a few cores: spinning OpenMP threads would fight
            env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        self.start = time.perf_counter()
        with log_path.open("w") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        Process.live.add(self)

    def kill(self) -> None:
        """Kill its whole session (also what it left behind after exiting): nothing of it keeps the GPU."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        Process.live.discard(self)

    def wait(self, timeout: float) -> tuple[int | None, float]:
        """(exit code, None when killed after `timeout` seconds from its start; seconds it ran)."""
        try:
            code: int | None = self.proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - self.start)))
        except subprocess.TimeoutExpired:
            code = None
        self.kill()
        return code, time.perf_counter() - self.start


# -- one run, as the parent sees it --------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    name: str
    engine: str  # "ftune" | "trl"
    packing: bool
    # ftune: what this bench compiles in its engine: "fused" (--compiled-fused; sft_job.prepare_engine)
    compiled: str = ""
    compile_layers: bool = True  # RunConfig.compile_layers (--eager-layers: false)

    @property
    def dir_name(self) -> str:
        return self.name.replace(" ", "-")


# The pairs first: a budget that runs out still leaves a comparison.
RUNS = (Run("ftune packed", "ftune", True), Run("trl packed", "trl", True),
        Run("ftune padded", "ftune", False), Run("trl padded", "trl", False))  # fmt: skip
EXTRA = {
    "eager": Run("ftune eager", "ftune", True, compile_layers=False),
    "fused": Run("ftune jit", "ftune", True, "fused", compile_layers=False),
}


def start_run(run: Run, setup: Setup, model: Path, data: Path, work: Path) -> Process:
    """Write the run's config and start its training process (this file's --ftune-entry or --trl-entry)."""
    from core.run_protocol import RunConfig

    out = work / run.dir_name
    out.mkdir(parents=True, exist_ok=True)
    spec = job_spec(setup, run.packing, model.name)
    if run.engine == "ftune":
        config = RunConfig(
            job_id=run.dir_name, spec=spec, model_dir=str(model), dataset_path=str(data), output_dir=str(out),
            compile_layers=run.compile_layers,
        )  # fmt: skip
        (out / "run.json").write_text(config.model_dump_json())
        entry = [
            "--ftune-entry",
            str(out / "run.json"),
            *(["--compile", run.compiled] if run.compiled else []),
        ]
    else:
        job = {
            "spec": json.loads(spec.model_dump_json()),
            "model_dir": str(model),
            "dataset_path": str(data),
            "output_dir": str(out),
        }
        (out / "job.json").write_text(json.dumps(job))
        entry = ["--trl-entry", str(out / "job.json")]
    cmd = [sys.executable, str(Path(__file__).resolve()), *entry]
    return Process(cmd, out / "log.txt", threads=1 if setup.smoke else None)


def collect(run: Run, setup: Setup, code: int | None, wall: float, work: Path) -> dict:
    """The run's row of the table, from what its process left in its directory."""
    out = work / run.dir_name
    row = _row(run, code, wall, out)
    return row | (_ftune_row(out, setup, run.packing) if run.engine == "ftune" else trl_row(out, run.packing))


def _ftune_row(out: Path, setup: Setup, packing: bool) -> dict:
    from core.run_protocol import StartRecord, StepRecord, read_error, read_records

    every = read_records(out / "metrics.jsonl")
    records = [r for r in every if isinstance(r, StepRecord)]
    start = next((r for r in every if isinstance(r, StartRecord)), None)
    peaks = json.loads((out / "cuda_peaks.json").read_text()) if (out / "cuda_peaks.json").exists() else {}
    row: dict[str, Any] = {
        "attn": "ftune_packed (varlen, one call a layer)" if packing and setup.attn == "sdpa" else setup.attn,
        "trainable_params": start.trainable_params if start else None,
        "plan_peak_bytes": start.predicted_peak_bytes if start else None,  # the planner's, for reference
        **outcome(len(records), [r.loss for r in records], peaks),
    }
    if "compiled" in peaks:
        row["compiled"] = peaks["compiled"]
    timed = [r for r in records if r.step >= 2]
    first = next((r for r in records if r.step == 1), None)
    if timed and first is not None:  # elapsed_s: the steps' seconds summed (training.recipe)
        row |= speed(sum(r.tokens for r in timed), None, timed[-1].elapsed_s - first.elapsed_s, len(timed))
    err = read_error(out / "error.json")
    if err:
        row["error"] = f"{err[0]}: {err[1][:300]}"
    return row


def _row(run: Run, code: int | None, wall: float, out: Path) -> dict:
    row: dict[str, Any] = {
        "run": run.name, "engine": run.engine, "packing": run.packing, "exit": code, "wall_s": round(wall, 1),
    }  # fmt: skip
    if code != 0:
        log = (out / "log.txt").read_text(errors="replace").splitlines() if (out / "log.txt").exists() else []
        row["log_tail"] = log[-25:]
        if code is None:
            row["error"] = f"timed out after {wall:.0f} s"
    return row


# -- the table -----------------------------------------------------------------------------------------------


def gpu_peak() -> tuple[str, float | None]:
    """(CUDA's name of GPU 0, its dense bf16 FLOP/s from core.planner.gpus; None where it is not known)."""
    import torch

    name = torch.cuda.get_device_name(0)
    gpu = gpu_check.gpu_by_name(name)
    return name, gpu.bf16_flops if gpu else None


def _fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-".rjust(int(spec.split(".")[0]))


def print_table(rows: list[dict]) -> None:
    print(
        f"{'run':14} {'exit':>4} {'steps':>5} {'tok/s':>8} {'loop tok/s':>10} {'ms/step':>8} {'tok/step':>8} "
        f"{'pad':>5} {'alloc GiB':>9} {'resv GiB':>8} {'MFU':>6} {'loss':>7}  attention"
    )
    for r in rows:
        gib = {k: (r[k] / 2**30 if r.get(k) else None) for k in ("max_allocated_bytes", "max_reserved_bytes")}
        cells = [
            _fmt(r.get("tokens_per_s"), "8.0f"),
            _fmt(r.get("loop_tokens_per_s"), "10.0f"),
            _fmt(r.get("ms_per_step"), "8.1f"),
            _fmt(r.get("tokens_per_step"), "8.0f"),
            _fmt(r.get("padding_share"), "5.0%"),
            _fmt(gib["max_allocated_bytes"], "9.2f"),
            _fmt(gib["max_reserved_bytes"], "8.2f"),
            _fmt(r.get("mfu"), "6.1%"),
            _fmt(r.get("final_loss"), "7.4f"),
        ]
        code = str(r["exit"]) if r["exit"] is not None else "skip" if r.get("skipped") else "T/O"
        print(f"{r['run']:14} {code:>4} {r.get('steps_done', 0):>5} {' '.join(cells)}  {r.get('attn', '-')}")
        if r.get("error"):
            print(f"{'':14} error: {r['error']}")
    for r in rows:  # below the table, whose rows a reader (and the smoke test) takes line by line
        if r.get("compiled"):
            c = r["compiled"]
            print(f"{r['run']}: torch.compile made {c['graphs']} graphs, {c['recompiles']} recompiles, "
                  f"{c['graph_breaks']} graph breaks {c['break_reasons'] or ''}")  # fmt: skip


def best(rows: list[dict], engine: str) -> dict | None:
    done = [r for r in rows if r["engine"] == engine and r["exit"] == 0 and r.get("tokens_per_s")]
    return max(done, key=lambda r: r["tokens_per_s"]) if done else None


# -- main ----------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run (GPU; smoke: 3)")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on, both sides")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "flash_attention_2"])
    parser.add_argument("--smoke", action="store_true", help="the tiny CPU run, also where CUDA is present")
    parser.add_argument(
        "--compiled-fused", action="store_true", help="also ftune with its fused functions compiled"
    )
    parser.add_argument(
        "--eager-layers", action="store_true", help="also ftune with its decoder layers run eagerly"
    )
    parser.add_argument("--keep", type=Path, help="work directory (default: a temporary one)")
    parser.add_argument(
        "--models", type=Path, help="where the model is built or found (default: WORK/models)"
    )
    parser.add_argument("--run-timeout", type=float, help="seconds per run (default 150; smoke 240)")
    parser.add_argument(
        "--budget", type=float, default=420, help="seconds for all runs together, model build included"
    )
    parser.add_argument("--json-out", type=Path, help="also write the JSON result here")
    parser.add_argument("--ftune-entry", help=argparse.SUPPRESS)
    parser.add_argument(
        "--compile", default="", help=argparse.SUPPRESS
    )  # the entry's: sft_job.prepare_engine
    parser.add_argument("--trl-entry", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ftune_entry:
        return ftune_entry(args.ftune_entry, args.compile)
    if args.trl_entry:
        return trl_entry(args.trl_entry)

    import torch

    def stop(signum: int, _frame: object) -> None:  # e.g. `timeout` around this script: no orphans
        for proc in list(Process.live):
            proc.kill()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    start = time.monotonic()
    cuda = torch.cuda.is_available()
    smoke = args.smoke or not cuda
    if smoke and not args.smoke:
        print(
            "gpu_vs_trl: no CUDA device here; running the smoke version (tiny model, 40 rows, 3 steps, fp32)"
        )
    setup = (
        smoke_setup(args.checkpointing, args.attn)
        if smoke
        else gpu_setup(args.steps, args.checkpointing, args.attn)
    )
    run_timeout = args.run_timeout or (240.0 if smoke else 150.0)
    work = args.keep or Path(tempfile.mkdtemp(prefix="ftune-gpu-vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(args.models or work / "models", smoke)
    data = write_rows(work / "rows.jsonl", setup.rows, setup.median_words)

    from core.arch import load_architecture

    params = load_architecture(model).total_params
    device, peak = gpu_peak() if cuda and not smoke else ("cpu", None)
    if setup.attn == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available

        if not is_flash_attn_2_available():
            print("gpu_vs_trl: --attn flash_attention_2 asked for but flash-attn is not installed")
            return 2
    print(
        f"gpu_vs_trl: {device} (bf16 peak {peak / 1e12:.0f} TFLOP/s)" if peak else f"gpu_vs_trl: {device}",
        f"model {model.name} ({params / 1e9:.2f}B parameters), {setup.rows} rows, {setup.steps} steps, "
        f"micro-batch {setup.micro_batch} x {setup.max_seq_len}, {'bf16' if not smoke else 'fp32'}, "
        f"gradient checkpointing {'on' if setup.checkpointing else 'off'}, attention {setup.attn}; "
        f"timed: steps 2..{setup.steps}; MFU = 6 x parameters x tok/s / bf16 peak",
        flush=True,
    )
    extra = [EXTRA[m] for m, on in (("eager", args.eager_layers), ("fused", args.compiled_fused)) if on]
    runs = [*RUNS[:2], *extra, *RUNS[2:]]  # after the packed pair, which a spent budget still leaves
    if smoke:  # a test of the script, not a measurement: all at once
        procs = [(run, start_run(run, setup, model, data, work)) for run in runs]
        rows = [collect(run, setup, *proc.wait(run_timeout), work) for run, proc in procs]
    else:  # one after another: each alone on the GPU
        rows = []
        for run in runs:
            left = args.budget - (time.monotonic() - start)
            if left < 30:
                why = f"skipped: the budget of {args.budget:.0f} s is spent"
                rows.append({"run": run.name, "engine": run.engine, "packing": run.packing, "exit": None,
                             "skipped": True, "error": why})  # fmt: skip
                print(f"gpu_vs_trl: {run.name}: skipped (budget spent)", flush=True)
                continue
            proc = start_run(run, setup, model, data, work)
            rows.append(collect(run, setup, *proc.wait(min(run_timeout, left)), work))
            r = rows[-1]
            print(f"gpu_vs_trl: {run.name}: exit {r['exit']}, {r.get('tokens_per_s') or 0:.0f} tok/s, "
                  f"{r['wall_s']} s", flush=True)  # fmt: skip
    for row in rows:
        if row.get("tokens_per_s") and peak:
            row["mfu"] = 6 * params * row["tokens_per_s"] / peak
    print()
    print_table(rows)
    f, t = best(rows, "ftune"), best(rows, "trl")
    ratio = f["tokens_per_s"] / t["tokens_per_s"] if f and t else None
    if f and t:
        note = "  (smoke: a tiny model on a CPU, all runs at once; not a measurement)" if smoke else ""
        print(
            f"\nftune best / TRL best: {f['run']} {f['tokens_per_s']:.0f} tok/s / {t['run']} "
            f"{t['tokens_per_s']:.0f} tok/s = {ratio:.2f}x{note}"
        )
    result = {
        "bench": "gpu_vs_trl",
        "smoke": smoke,
        "device": device,
        "bf16_peak_flops": peak,
        "total_params": params,
        "steps": setup.steps,
        "micro_batch": setup.micro_batch,
        "max_seq_len": setup.max_seq_len,
        "rows_in_data": setup.rows,
        "checkpointing": setup.checkpointing,
        "attn": setup.attn,
        "mfu_formula": "6 * total_params * tokens_per_s / bf16_peak_flops",
        "ftune_best": f["run"] if f else None,
        "trl_best": t["run"] if t else None,
        "ratio_ftune_best_over_trl_best": ratio,
        "runs": rows,
    }
    line = json.dumps(result)
    print(line)
    if args.json_out:
        args.json_out.write_text(line + "\n")
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
