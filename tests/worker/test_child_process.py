"""The worker's children stop when the worker process ends, and only then: not when the thread that
started them ends (PR_SET_PDEATHSIG's rule), and also a grandchild (a torchrun rank) does.

A real "worker" process starts its child with worker.supervision.spawn from a short-lived thread; the child is
a stand-in for training that calls core.process.stop_with_worker() first, as training.run does, and
records the SIGTERM it gets before exiting with EXIT_STOPPED."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker import supervision

REPO = Path(__file__).resolve().parents[2]

# The training stand-in: ties itself to the worker, writes its pid, then works until SIGTERM. With
# `nested`, it first starts a copy of itself (as torchrun starts ranks), which inherits the environment.
CHILD = """
import os, signal, subprocess, sys, time
from pathlib import Path
from core.process import stop_with_worker
stop_with_worker()
out = Path(sys.argv[1])
def stopped(*_):
    (out / f"stopped-{os.getpid()}").write_text("SIGTERM")
    sys.exit(3)
signal.signal(signal.SIGTERM, stopped)
if sys.argv[2] == "nested":
    subprocess.Popen([sys.executable, "-c", sys.argv[3], str(out), "rank", sys.argv[3]])
(out / f"pid-{os.getpid()}").write_text(sys.argv[2])
while True:
    time.sleep(0.1)
"""

# The "worker": spawns the child from a thread that then ends, and lives on until killed.
WORKER = """
import sys, threading, time
from pathlib import Path
from worker.supervision import spawn
out = Path(sys.argv[1])
def start():
    spawn([sys.executable, "-c", sys.argv[2], str(out), sys.argv[3], sys.argv[2]], out / "child.log")
t = threading.Thread(target=start)
t.start()
t.join()
(out / "thread-ended").write_text("")
while True:
    time.sleep(1)
"""


def _start_worker(tmp_path: Path, mode: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, str(tmp_path), CHILD, mode], cwd=REPO, start_new_session=True
    )


def _wait(predicate, timeout: float = 20) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _pids(tmp_path: Path) -> dict[int, str]:
    return {int(p.name.split("-")[1]): p.read_text() for p in tmp_path.glob("pid-*")}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(") ", 1)[1][0] != "Z"


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_child_outlives_the_thread_that_started_it_but_not_the_worker(tmp_path: Path) -> None:
    worker = _start_worker(tmp_path, "single")
    try:
        assert _wait(lambda: len(_pids(tmp_path)) == 1 and (tmp_path / "thread-ended").exists())
        (child,) = _pids(tmp_path)
        time.sleep(1.5)
        assert _alive(child) and not list(tmp_path.glob("stopped-*")), "stopped when its thread ended"
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        assert _wait(lambda: not _alive(child), timeout=10), "the child outlived its worker"
        assert (tmp_path / f"stopped-{child}").read_text() == "SIGTERM"  # stopped as on a cancel
    finally:
        worker.kill()
        worker.wait()
        _kill_all(list(_pids(tmp_path)))


def test_a_grandchild_stops_with_the_worker_too(tmp_path: Path) -> None:
    worker = _start_worker(tmp_path, "nested")
    try:
        assert _wait(lambda: sorted(_pids(tmp_path).values()) == ["nested", "rank"])
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        pids = list(_pids(tmp_path))
        assert _wait(lambda: not any(_alive(p) for p in pids), timeout=10), "a rank outlived its worker"
        assert {int(p.name.split("-")[1]) for p in tmp_path.glob("stopped-*")} == set(pids)
    finally:
        worker.kill()
        worker.wait()
        _kill_all(list(_pids(tmp_path)))


def test_spawn_names_the_worker_in_the_childs_environment(tmp_path: Path) -> None:
    proc = supervision.spawn(
        [sys.executable, "-c", "import os; print(os.environ['FTUNE_WORKER_PID'])"], tmp_path / "log"
    )
    assert proc.wait(30) == 0
    assert (tmp_path / "log").read_text().strip() == str(os.getpid())


def test_each_of_a_workers_runs_gets_its_share_of_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    cpus = len(os.sched_getaffinity(0))
    assert supervision.threads_per_run(1) is None  # one run at a time: torch's own choice
    assert supervision.threads_per_run(2) == max(1, cpus // 2)
    assert supervision.threads_per_run(4 * cpus) == 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert "OMP_NUM_THREADS" not in supervision.training_env(None)
    assert supervision.training_env(3)["OMP_NUM_THREADS"] == "3"
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the worker's own setting wins
    assert supervision.training_env(3)["OMP_NUM_THREADS"] == "5"
