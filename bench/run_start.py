"""A training run's time from the worker's start to its exit: a fresh process (`python -m training.run`,
imports and all) against one forked from the warm fork server (worker.forking), one run alone and two at
once, at 1 and 2 OpenMP threads a process, side by side.

    .venv/bin/python bench/run_start.py [--steps 60] [--rounds 1] [--threads 1,2]

Each run trains the demo model (training.demo) on examples/alpaca_small.jsonl for --steps optimizer
steps through the worker's own starting code (worker.supervision.spawn and training_command, or
ForkServer.fork), and is timed from the call that starts it to its exit; "steps s" is the training
loop's own time (the last StepRecord's elapsed_s), so "wall - steps" is what starting cost. The fork
server is started once per thread count (its OpenMP runtime reads OMP_NUM_THREADS when it loads) and is
warm before the first forked run is timed. On 2 cores (2026-11-28, 60 steps, seconds wall / the loop's
own): 1 thread alone fresh 36.2 / 29.3, forked 33.2 / 31.5; two at once 40.2 / 31.4 and 29.1 / 28.0; 2
threads alone 27.0 / 19.2 and 19.5 / 18.4; two at once 234.4 / 225.9 and 418.0 / 416.2 (their OpenMP
threads spinning at barriers while the other run holds the cores: why a worker gives each of its runs
its share of the CPUs, worker.supervision.threads_per_run, and `make test` one thread a process).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core.run_protocol import EXIT_OK, RunConfig, StepRecord, read_records  # noqa: E402
from core.spec import JobSpec  # noqa: E402
from training.demo import build_demo_model  # noqa: E402
from worker.forking import ForkServer  # noqa: E402
from worker.supervision import Child, spawn, training_command, training_env  # noqa: E402


def write_config(work: Path, name: str, model: Path, steps: int) -> Path:
    out = work / name
    out.mkdir(parents=True)
    spec = JobSpec(base_model=model.name, dataset_id="bench0001", max_steps=steps, checkpoint_every_steps=0)
    config = RunConfig(
        job_id=name,
        spec=spec,
        model_dir=str(model),
        dataset_path=str(ROOT / "examples" / "alpaca_small.jsonl"),
        output_dir=str(out),
    )
    path = out / "run.json"
    path.write_text(config.model_dump_json())
    return path


def run_together(runs: list[Path], forks: ForkServer | None) -> list[tuple[float, float]]:
    """Start every run at once (fresh, or forked from `forks`) and wait for all; per run (wall seconds
    from its start to its exit, the training loop's seconds)."""
    started = time.perf_counter()
    children: list[Child] = []
    for run_json in runs:
        log = run_json.parent / "log.txt"
        child = forks.fork(run_json, log, training_env()) if forks else spawn(training_command(run_json), log)
        if child is None:
            raise RuntimeError("the fork server did not fork the run")
        children.append(child)
    ended: dict[int, float] = {}
    while len(ended) < len(children):
        for i, child in enumerate(children):
            if i not in ended and (code := child.poll()) is not None:
                if code != EXIT_OK:
                    raise RuntimeError(f"{runs[i]} exited {code}: see {runs[i].parent / 'log.txt'}")
                ended[i] = time.perf_counter() - started
        time.sleep(0.05)
    results = []
    for i, run_json in enumerate(runs):
        steps = [r for r in read_records(run_json.parent / "metrics.jsonl") if isinstance(r, StepRecord)]
        results.append((ended[i], steps[-1].elapsed_s))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=1, help="each case this many times, interleaved")
    parser.add_argument("--threads", default="1,2", help="OpenMP threads a process, comma-separated")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ftune-run-start-"))
    model = build_demo_model(work / "models")
    print(f"run_start: the demo model, {args.steps} steps a run, {os.cpu_count()} CPUs; seconds (wall: until")
    print("every run of the case ended; steps: the training loops' own time, the mean over its runs)")
    header = ("threads", "runs", "round", "fresh wall", "steps", "forked wall", "steps")
    print("".join(f"{h:>12}" for h in header))
    count = 0
    for threads in [int(t) for t in args.threads.split(",")]:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for the fresh runs and the server started now
        forks = ForkServer()
        forks.start()
        if not (forks.wait(180) and forks.ready()):
            print("run_start: the fork server does not serve here (see its log line above)")
            return 1
        try:
            for together in (1, 2):
                for rnd in range(1, args.rounds + 1):
                    cells: list[float] = []
                    for mode in (None, forks):
                        runs = []
                        for _ in range(together):
                            count += 1
                            runs.append(write_config(work, f"run{count}", model, args.steps))
                        timed = run_together(runs, mode)
                        cells += [max(w for w, _ in timed), sum(s for _, s in timed) / len(timed)]
                    row = [f"{threads:>12}", f"{together:>12}", f"{rnd:>12}", *(f"{c:>12.1f}" for c in cells)]
                    print("".join(row), flush=True)
        finally:
            forks.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
