"""ftune's engine against TRL's SFTTrainer (as configured by default and at its documented fastest) and
Unsloth on one GPU: the same model, data, LoRA or QLoRA, batch, precision and gradient checkpointing, each
run in a process of its own.

    python3 bench/gpu_vs_trl.py [--steps 30] [--warmup 3] [--checkpointing] [--qlora] [--runs A,B,...]
                                [--compiled-fused] [--eager-layers] [--keep DIR] [--models DIR]
                                [--json-out FILE]

Builds (bench/sft_job.py) a ~1.1B-parameter Llama-shaped model (bench/gpu_check.py's shape and name: random
weights, the demo tokenizer, no download; --models reuses one gpu_check.py built) and 2,000 chat rows (a
user turn and an assistant reply, lognormal lengths, median ~120 words) as JSONL, then trains these runs
of N steps (--runs: which, in that order; by default all but the A/B rows, which their flags add after
the first two runs):

  ftune packed      the real engine: a RunConfig and `python -m training.run run.json` (through this
  ftune padded      file's --ftune-entry, which reads the CUDA allocator's peaks in the training process
                    after it); its decoder layers compiled for the training step where the engine
                    compiles them (training.compiled: on CUDA, LoRA on unquantized weights, no
                    checkpointing)
  trl packed        TRL's SFTTrainer as configured by default for the job (bench/trl_reference.py):
                    packing=True (BFD, padding-free), SDPA, LoRA weights fp32 (peft's default)
  trl fastest       TRL at its documented fastest: packing=True, padding_free=True, use_liger_kernel=True,
                    torch_compile=True, bf16=True, and the best padding-free attention installed
                    (flash_attention_3/2, kernels-community/flash-attn2, else flex_attention, else SDPA);
                    each component only where it imports, and the row says what it used and why not
  trl fastest bf16  the same with the LoRA weights in bf16 (a PeftModel built with
                    autocast_adapter_dtype=False: TRL's way to have them; QLoRA's are bf16 in any row)
  trl fastest sdpa  trl fastest with SDPA (transformers' block mask from position_ids), in case the
                    varlen attention it picked fails or is slower
  unsloth           Unsloth's FastLanguageModel + its patched SFTTrainer, packed and padding-free
                    (`unavailable: <reason>` where it does not import: see trl_reference)
  trl padded        TRL's SFTTrainer, padded micro-batches (transformers' length-grouped sampler, where it
                    has one: ftune's padded batches are length-grouped too)
  ftune eager       with --eager-layers, after the first two runs: ftune packed with its layers run
                    eagerly (RunConfig.compile_layers false: the worker's FTUNE_COMPILE_LAYERS=false)
  ftune jit         with --compiled-fused: ftune eager, with the engine's fused norms, gates and rotary
                    embeddings compiled (training.fused, jit=True), not run eagerly

Below the table, each row's exact configuration (the opponent's SFTConfig fields as set, the components it
used with their versions, and those it asked for and could not use, with the reason), then what
torch.compile made in each run that compiled (graphs, recompiles, graph breaks).

Both sides: LoRA r16 alpha 32 dropout 0 on all linear layers (--qlora: on an nf4 4-bit base with double
quantisation, compute in bf16, on both sides); base weights bf16 under bf16 autocast; micro-batch 8 x
max_seq_len 1024 (packed: 8 rows of up to 1024 tokens, one flat row of up to 8192 tokens on both sides);
AdamW (torch), lr 1e-4 decaying linearly, no warmup, gradients clipped at 1.0; gradient checkpointing off
(--checkpointing: on, non-reentrant, on both sides; Unsloth's own "unsloth" mode); attention SDPA (--attn)
unless a row picks its own. Every side trains the very token ids and labels ftune does: the rows are
tokenized once by ftune's own code (training.data.load_for_training: chat template, loss on the reply)
and handed to the opponent pre-tokenized (input_ids + labels), which it then packs or pads itself.

Measured per run over steps W+1..N (W = --warmup, 3 on a GPU: a compiled run's first steps compile, and an
opponent's whole-model compile may compile again for the second shape it sees; an opponent's later step in
which torch.compile made a graph is left out too, and counted):
  tok/s    real input tokens (padding never counted) per second of step time. ftune: its StepRecords
           (`tokens`; the step seconds summed in `elapsed_s`: each step is timed around training.step's
           train_step, which waits for the device when it reads the loss and the gradient norm). TRL and
           Unsloth: a TrainerCallback that calls torch.cuda.synchronize() at on_step_begin and on_step_end
           and times what lies between; the tokens of each micro-batch counted as it enters training_step
           (attention_mask.sum(); a padding-free row carries no padding: its length). "loop tok/s": over the
           whole loop from the end of step W to the end of step N, data loading, logging and compiling
           included.
  MFU      two counts (bench/flops.py, where the formulas and their sources are): "MFU LoRA" = (4 N_mm +
           6 N_lora + 3 x causal attention's forward) x tok/s / the GPU's dense bf16 peak
           (planner.gpus), N_mm the blocks' linears and the output layer, attention over each
           example's own length; "MFU 6N" = 6 x every parameter x tok/s / peak, as in earlier tables.
  memory   torch.cuda.max_memory_allocated / max_memory_reserved in the training process, after training.
  loss     the last step's loss. "check": whether the run trains as the reference does (TRL's default
           packed row, else ftune's; the padded rows against the padded ones): first loss within 2%, mean
           of the last 5 within 3%, and from 10 steps on a drop of at least 5% from the first. "TRL best"
           and "Unsloth best" are their fastest rows that pass; ftune's best likewise.

Attention under packing: ftune makes one attention call per layer for the whole packed batch
(training.packing: torch's varlen flash attention on CUDA). TRL's padding-free rows have no
attention_mask, only position_ids that restart per example; under SDPA transformers 5 builds a
block-diagonal mask from them (masking_utils.find_packed_sequence_indices, used when no KV cache is
made: SFTTrainer passes use_cache=False): correct, but a T x T masked SDPA over the whole 8192-token row;
under flex_attention the same mask is block-sparse. TRL's docs name FlashAttention for padding-free:
flash-attn has no wheel on PyPI, and the GPU machines can neither build nor download it.

Each run has a timeout (--run-timeout) and all runs a budget (--budget), so a stuck run cannot eat the
time of the others. Without CUDA, or with --smoke, the same runs train a tiny model on 40 rows for 3
steps in fp32, all at once (one thread each; ftune's CPU memory profiling off; Liger and torch_compile
skipped, each with its reason): a test of this script (tests/e2e/test_gpu_vs_trl.py), not a measurement.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import flops  # noqa: E402  # both MFU counts
from race import (  # noqa: E402  # which runs, and how their rows are judged and shown
    CATALOG,
    Run,
    best,
    check_losses,
    describe,
    fmt,
    gpu_peak,
    print_table,
    runs_asked,
    same_as_ran,
)
from sft_job import (  # noqa: E402
    Setup,
    build_model,
    gpu_setup,
    job_spec,
    prepare_engine,
    sequence_lengths,
    smoke_setup,
    write_rows,
)
from trl_reference import (  # noqa: E402  # the opponents' side
    compile_counts,
    cuda_peaks,
    outcome,
    speed,
    trl_entry,
    trl_row,
)

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


class Process:
    """A training process in a session of its own, its output to `log_path`. Its session is killed
    whole on a timeout, and when this process gets SIGTERM (see `main`)."""

    live: set[Process] = set()

    def __init__(
        self, cmd: list[str], log_path: Path, threads: int | None = None, site: str | None = None
    ) -> None:
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
        if threads:  # processes side by side on a few cores: spinning OpenMP threads would fight
            env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        if site:  # packages for this run alone, ahead of the rest (Unsloth's pinned TRL and datasets)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p)
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


def start_run(run: Run, setup: Setup, model: Path, data: Path, work: Path) -> Process:
    """Write the run's config and start its training process (this file's --ftune-entry or --trl-entry)."""
    from core.run_protocol import RunConfig

    out = work / run.dir_name
    out.mkdir(parents=True, exist_ok=True)
    spec = job_spec(setup, run.packing, model.name)
    site = None
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
            "variant": run.variant.as_json(),
        }
        (out / "job.json").write_text(json.dumps(job))
        entry = ["--trl-entry", str(out / "job.json")]
        if run.engine == "unsloth":
            site = os.environ.get("UNSLOTH_SITE")  # bench/gpu_session.sh: Unsloth and its pinned TRL
    cmd = [sys.executable, str(Path(__file__).resolve()), *entry]
    return Process(cmd, out / "log.txt", threads=1 if setup.smoke else None, site=site)


def collect(run: Run, setup: Setup, code: int | None, wall: float, work: Path, warmup: int) -> dict:
    """The run's row of the table, from what its process left in its directory."""
    out = work / run.dir_name
    if run.engine == "ftune":
        found = _ftune_row(out, setup, run.packing, warmup)
    else:
        found = trl_row(out, run.packing, warmup)
    row = _row(run, code, wall, out, unavailable="unavailable" in found)
    return row | found


def _ftune_row(out: Path, setup: Setup, packing: bool, warmup: int) -> dict:
    from core.run_protocol import StartRecord, StepRecord, read_error, read_records

    every = read_records(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    records = [r for r in every if isinstance(r, StepRecord)]
    start = next((r for r in every if isinstance(r, StartRecord)), None)
    peaks = json.loads((out / "cuda_peaks.json").read_text()) if (out / "cuda_peaks.json").exists() else {}
    row: dict[str, Any] = {
        "attn": "ftune_packed (varlen, one call a layer)" if packing and setup.attn == "sdpa" else setup.attn,
        "trainable_params": start.trainable_params if start else None,
        "plan_peak_bytes": start.predicted_peak_bytes if start else None,  # the planner's, for reference
        "plan_reserved_bytes": start.predicted_reserved_bytes if start else None,
        **outcome(len(records), [r.loss for r in records if r.loss is not None], peaks),
    }
    if "compiled" in peaks:
        row["compiled"] = peaks["compiled"]
    timed = [r for r in records if r.step > warmup]
    first = next((r for r in records if r.step == warmup), None)
    if timed and first is not None:  # elapsed_s: the steps' seconds summed (training.recipe)
        row |= speed(sum(r.tokens for r in timed), None, timed[-1].elapsed_s - first.elapsed_s, len(timed))
    err = read_error(out / "error.json")
    if err:
        row["error"] = f"{err[0]}: {err[1][:300]}"
    return row


def _row(run: Run, code: int | None, wall: float, out: Path, unavailable: bool = False) -> dict:
    row: dict[str, Any] = {
        "run": run.name, "engine": run.engine, "packing": run.packing, "exit": code, "wall_s": round(wall, 1),
    }  # fmt: skip
    if unavailable:  # the opponent did not import here: not a failure of this bench
        row["exit"] = None
    elif code != 0:
        log = (out / "log.txt").read_text(errors="replace").splitlines() if (out / "log.txt").exists() else []
        row["log_tail"] = log[-25:]
        if code is None:
            row["error"] = f"timed out after {wall:.0f} s"
    return row


# -- main ----------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run (GPU; smoke: 3)")
    parser.add_argument("--warmup", type=int, help="steps not timed (default 3 on a GPU, 1 in the smoke)")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on, both sides")
    parser.add_argument("--qlora", action="store_true", help="QLoRA (nf4 4-bit base weights), both sides")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "flash_attention_2"])
    parser.add_argument("--runs", help=f"comma-separated, in order, of: {', '.join(CATALOG)}")
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
    runs = runs_asked(args.runs, args.eager_layers, args.compiled_fused)

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
    method = "qlora" if args.qlora else "lora"
    setup = (
        smoke_setup(args.checkpointing, args.attn, method=method)
        if smoke
        else gpu_setup(args.steps, args.checkpointing, args.attn, method)
    )
    warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
    if not 0 < warmup < setup.steps:
        raise SystemExit(f"gpu_vs_trl: --warmup must leave a timed step of {setup.steps}")
    run_timeout = args.run_timeout or (240.0 if smoke else 150.0)
    work = args.keep or Path(tempfile.mkdtemp(prefix="ftune-gpu-vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(args.models or work / "models", smoke)
    data = write_rows(work / "rows.jsonl", setup.rows, setup.median_words)

    from core.arch import load_architecture

    arch = load_architecture(model)
    spec = job_spec(setup, True, model.name)
    count = flops.count(
        arch,
        sequence_lengths(model, data, spec),
        arch.lora_params(spec.lora_target_modules, spec.lora_r),
        max_len=setup.max_seq_len,
    )
    device, peak = gpu_peak() if cuda and not smoke else ("cpu", None)
    if setup.attn == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available

        if not is_flash_attn_2_available():
            print("gpu_vs_trl: --attn flash_attention_2 asked for but flash-attn is not installed")
            return 2
    print(
        f"gpu_vs_trl: {device} (bf16 peak {peak / 1e12:.0f} TFLOP/s)" if peak else f"gpu_vs_trl: {device}",
        f"model {model.name} ({arch.total_params / 1e9:.2f}B parameters), {setup.rows} rows, {setup.steps} "
        f"steps, {setup.method}, micro-batch {setup.micro_batch} x {setup.max_seq_len}, "
        f"{'bf16' if not smoke else 'fp32'}, "
        f"gradient checkpointing {'on' if setup.checkpointing else 'off'}, attention {setup.attn}; "
        f"timed: steps {warmup + 1}..{setup.steps}",
        flush=True,
    )
    print(f"gpu_vs_trl: MFU = FLOPs per real token x tok/s / bf16 peak; {count.describe()}", flush=True)
    if smoke:  # a test of the script, not a measurement: all at once
        procs = [(run, start_run(run, setup, model, data, work)) for run in runs]
        rows = [collect(run, setup, *proc.wait(run_timeout), work, warmup) for run, proc in procs]
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
            same = same_as_ran(run, rows)
            if same:
                rows.append({"run": run.name, "engine": run.engine, "packing": run.packing, "exit": None,
                             "skipped": True, "error": same})  # fmt: skip
                print(f"gpu_vs_trl: {run.name}: skipped ({same})", flush=True)
                continue
            proc = start_run(run, setup, model, data, work)
            rows.append(collect(run, setup, *proc.wait(min(run_timeout, left)), work, warmup))
            r = rows[-1]
            why = f" ({r['error']})" if r.get("error") else ""
            print(f"gpu_vs_trl: {run.name}: exit {r['exit']}, {r.get('tokens_per_s') or 0:.0f} tok/s, "
                  f"{r['wall_s']} s{why}", flush=True)  # fmt: skip
    for row in rows:
        row |= count.mfu(row.get("tokens_per_s"), peak)
    check_losses(rows)
    print()
    print_table(rows, setup)
    bests = {engine: best(rows, engine) for engine in ("ftune", "trl", "unsloth")}
    opponents = [b for b in (bests["trl"], bests["unsloth"]) if b]
    opponent = max(opponents, key=lambda r: r["tokens_per_s"]) if opponents else None
    f = bests["ftune"]

    def ratio(other: dict | None) -> float | None:
        return f["tokens_per_s"] / other["tokens_per_s"] if f and other else None

    note = "  (smoke: a tiny model on a CPU, all runs at once; not a measurement)" if smoke else ""
    print()
    for label, b in (("ftune best", f), ("TRL best", bests["trl"]), ("Unsloth best", bests["unsloth"])):
        unsloth_row = next((r for r in rows if r["engine"] == "unsloth"), None)
        if b:
            mfu = fmt(b.get("mfu_lora"), "1.1%")
            print(f"{label}: {b['run']} {b['tokens_per_s']:.0f} tok/s, MFU LoRA {mfu}")
        elif label == "Unsloth best" and unsloth_row and unsloth_row.get("unavailable"):
            print(f"{label}: unavailable: {unsloth_row['unavailable']}")
        else:
            print(f"{label}: none (no such row ran, or none trained as the reference does)")
    if f and opponent:
        print(
            f"ftune best / opponent best: {f['run']} {f['tokens_per_s']:.0f} tok/s / {opponent['run']} "
            f"{opponent['tokens_per_s']:.0f} tok/s = {ratio(opponent):.2f}x{note}"
        )
    result = {
        "bench": "gpu_vs_trl",
        "smoke": smoke,
        "device": device,
        "bf16_peak_flops": peak,
        "total_params": arch.total_params,
        "method": setup.method,
        "steps": setup.steps,
        "warmup_steps": warmup,
        "micro_batch": setup.micro_batch,
        "max_seq_len": setup.max_seq_len,
        "rows_in_data": setup.rows,
        "checkpointing": setup.checkpointing,
        "attn": setup.attn,
        "flops": count.as_json(),
        "mfu_formulas": {
            "mfu_lora": f"({count.as_json()['lora_formula']}) * tokens_per_s / bf16_peak_flops",
            "mfu_6n": "6 * n_total * tokens_per_s / bf16_peak_flops",
        },
        "ftune_best": f["run"] if f else None,
        "trl_best": bests["trl"]["run"] if bests["trl"] else None,
        "unsloth_best": bests["unsloth"]["run"] if bests["unsloth"] else None,
        "opponent_best": opponent["run"] if opponent else None,
        "ratio_ftune_best_over_trl_best": ratio(bests["trl"]),
        "ratio_ftune_best_over_opponent_best": ratio(opponent),
        "runs": [r | {"configuration": describe(r, setup)} for r in rows],
    }
    line = json.dumps(result, default=str)
    print(line)
    if args.json_out:
        args.json_out.write_text(line + "\n")
    return 0 if all(r["exit"] == 0 for r in rows if not r.get("skipped")) else 1


if __name__ == "__main__":
    sys.exit(main())
