"""Starting the training subprocess and watching it until it exits.

No database here: what the run reports is handed to `relay` (worker.recording), and whether to stop it is
asked of `stop_wanted`. A stop is a SIGTERM, sent once, on which training checkpoints and exits with
core.run_protocol.EXIT_STOPPED (a pause, a cancel, this worker shutting down, or a lost lease).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from core.process import child_env
from core.run_protocol import EXIT_STOPPED, Record, RecordTail, RunConfig, StoppedRecord
from worker.nodes import Node, node_launcher

# torchrun forwards our SIGTERM to its ranks and SIGKILLs them after this long (its default is 30 s):
# enough for the step in flight and a checkpoint.
SHUTDOWN_TIMEOUT_S = 600


def training_processes(run_json: Path) -> int:
    """How many processes the run trains in on this node: one, or one FSDP rank per device (num_gpus)."""
    return RunConfig.model_validate_json(run_json.read_text()).spec.num_gpus


def training_command(run_json: Path, node: Node | None = None) -> list[str]:
    """One process, or with num_gpus > 1 one FSDP rank per device under torchrun (gloo ranks on a CPU);
    `node`: this worker's node of a multi-node job, under torchrun's c10d rendezvous."""
    from training import run  # standard library and core only at import: for its name, never called

    n = training_processes(run_json)
    if node is not None:
        return [*node_launcher(node, n), "-m", run.__name__, str(run_json)]
    if n == 1:
        return [sys.executable, "-m", run.__name__, str(run_json)]
    # --standalone: a private rendezvous on a free port, so jobs on one machine do not collide.
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
    return [*launcher, "-m", run.__name__, str(run_json)]


class Child(Protocol):
    """A training run as supervise watches it: a subprocess.Popen, or a worker.forking.ForkedRun."""

    pid: int

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...


def threads_per_run(concurrency: int) -> int | None:
    """The OpenMP threads each of a worker's `concurrency` runs at once may use: its share of this
    machine's CPUs. Runs side by side with a thread per core each spin at their barriers
    (bench/run_start.py, 2026-11-28, 2 cores, 60 demo steps: two runs at once with 2 threads each took
    234-418 s, with 1 thread each 29-40 s). None for a worker of one run at a time: torch's own choice."""
    if concurrency <= 1:
        return None
    return max(1, len(os.sched_getaffinity(0)) // concurrency)


def training_env(threads: int | None = None) -> dict[str, str]:
    """The training process's environment, however it starts: it stops itself when this process ends
    (core.process.stop_with_worker, told our pid by child_env). `threads`: its OpenMP threads
    (threads_per_run), unless this worker's environment sets OMP_NUM_THREADS."""
    env = child_env(PYTHONUNBUFFERED="1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT=str(SHUTDOWN_TIMEOUT_S))
    if threads and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def spawn(command: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start `command` as a child of this worker, its output appended to log_path, in `env` (default:
    training_env()). No preexec_fn (not fork-safe in a threaded worker)."""
    with log_path.open("ab") as log:
        return subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C on the terminal reaches us, not the trainer
            env=env if env is not None else training_env(),
        )


def supervise(
    start: Callable[[], Child | None],
    *,
    metrics_path: Path,
    interval: float,
    started: Callable[[int], None],
    relay: Callable[[list[Record]], bool],
    stop_wanted: Callable[[], bool],
) -> int | None:
    """Start the run (`start`) and watch it to its end, handing each poll's new records to `relay` (False:
    the job is no longer ours). `start` returns None, having waited about an interval, while the run cannot
    start yet (a fork server importing): the lease is kept meanwhile, and a stop asked for then reaches the
    run at its first poll. Returns the exit code to judge, EXIT_STOPPED for a run that recorded a stop, or
    None when the job was lost to another worker."""
    tail = RecordTail(metrics_path)
    tail.read_new()  # skip records of earlier attempts
    proc = start()
    while proc is None:
        if not relay([]):
            return None
        proc = start()
    started(proc.pid)
    stop_sent = False
    owned = True
    stopped = False  # torchrun exits 1 whatever its ranks return, so a stop is read from the metrics
    while proc.poll() is None:
        time.sleep(interval)
        records = tail.read_new()
        stopped = stopped or any(isinstance(r, StoppedRecord) for r in records)
        owned = relay(records)
        if not stop_sent and (not owned or stop_wanted()):
            proc.send_signal(signal.SIGTERM)
            stop_sent = True
    records = tail.read_new()
    stopped = stopped or any(isinstance(r, StoppedRecord) for r in records)
    owned = relay(records) and owned
    if not owned:
        return None
    rc = proc.poll()
    assert rc is not None
    return EXIT_STOPPED if stopped and rc != 0 else rc
