"""The training fork server (training.forkserver) with the worker's client (worker.forking): a forked run
trains exactly as a fresh `python -m training.run` does, and the worker learns how each run ended."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from core.run_protocol import EXIT_FAILED, EXIT_OK, EXIT_STOPPED
from core.storage import ADAPTER_DIR, CHECKPOINTS_DIR, ERROR_FILE, METRICS_FILE
from tests.training.util import read_jsonl
from worker.forking import ForkedRun, ForkServer
from worker.supervision import Child, spawn, training_command, training_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def forks() -> Iterator[ForkServer]:
    server = ForkServer()
    yield server
    server.close()


def write_run(config, tmp_path: Path) -> Path:
    path = tmp_path / f"{config.job_id}.json"
    path.write_text(config.model_dump_json())
    return path


def wait(child: Child, timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while (rc := child.poll()) is None:
        assert time.monotonic() < deadline, "the run did not end"
        time.sleep(0.05)
    return rc


def forked(forks: ForkServer, run_json: Path, log: Path, env: dict[str, str] | None = None) -> ForkedRun:
    """Fork as the worker does: start the server if none runs, wait for its imports, fork."""
    forks.start()
    assert forks.wait(timeout=300) and forks.ready(), "the fork server did not come up"
    run = forks.fork(run_json, log, env or training_env())
    assert run is not None, "the ready server did not fork"
    return run


def steps_of(output_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(output_dir / METRICS_FILE) if r["type"] == "step"]


def test_a_forked_run_trains_as_a_fresh_process_would(forks: ForkServer, make_config, tmp_path: Path) -> None:
    """Same config, once as the worker starts a fresh process and once forked: the same losses and
    gradient norms step by step and the same adapter, bit for bit; the forked one logs to its log file,
    in a session of its own."""
    runs = {}
    for how in ("fresh", "forked"):
        config = make_config(name=how, max_steps=4, seed=7)
        run_json, log = write_run(config, tmp_path), tmp_path / f"{how}.log"
        child = spawn(training_command(run_json), log) if how == "fresh" else forked(forks, run_json, log)
        deadline = time.monotonic() + 10
        while how == "forked" and os.getsid(child.pid) != child.pid:  # its first act, after the pid is sent
            assert time.monotonic() < deadline, "the forked run is not a session of its own"
        assert wait(child) == EXIT_OK, log.read_text()
        runs[how] = Path(config.output_dir)
        assert "step 4/4" in log.read_text()
    fresh, fork = (steps_of(runs[h]) for h in ("fresh", "forked"))
    assert [(r["loss"], r["grad_norm"]) for r in fork] == [(r["loss"], r["grad_norm"]) for r in fresh]
    weights = [load_file(runs[h] / ADAPTER_DIR / "adapter_model.safetensors") for h in ("fresh", "forked")]
    assert weights[0].keys() == weights[1].keys()
    assert all(weights[0][k].equal(weights[1][k]) for k in weights[0])


def test_the_worker_learns_how_a_forked_run_ended(forks: ForkServer, make_config, tmp_path: Path) -> None:
    """A failed run exits EXIT_FAILED with its error.json; a SIGTERM stops a run at a checkpoint
    (EXIT_STOPPED); a SIGKILL reads as -9, as subprocess reports it. A run takes its OpenMP threads from
    the environment it is given (the worker's share for it), not the server's."""
    failing = make_config(name="failing", max_steps=2)
    Path(failing.dataset_path).unlink()
    assert wait(forked(forks, write_run(failing, tmp_path), tmp_path / "failing.log")) == EXIT_FAILED
    assert json.loads((Path(failing.output_dir) / ERROR_FILE).read_text())["code"]

    for name, sig, expected in (
        ("stopped", signal.SIGTERM, EXIT_STOPPED),
        ("killed", signal.SIGKILL, -signal.SIGKILL),
    ):
        config = make_config(name=name, max_steps=10_000)
        threads = "2" if os.environ.get("OMP_NUM_THREADS") != "2" else "3"  # not what the server has
        env = training_env() | {"OMP_NUM_THREADS": threads}
        run = forked(forks, write_run(config, tmp_path), tmp_path / f"{name}.log", env)
        deadline = time.monotonic() + 120
        while not (Path(config.output_dir) / METRICS_FILE).exists() or not steps_of(Path(config.output_dir)):
            assert time.monotonic() < deadline and run.poll() is None, "no step reported"
            time.sleep(0.05)
        run.send_signal(sig)
        assert wait(run) == expected
        assert f"(CPU threads: {threads})" in (tmp_path / f"{name}.log").read_text()
        if sig == signal.SIGTERM:
            assert any((Path(config.output_dir) / CHECKPOINTS_DIR).iterdir())


def test_a_run_outlives_its_server_and_the_server_comes_back(
    forks: ForkServer, make_config, tmp_path: Path
) -> None:
    """A server that dies does not take its runs with it: the run goes on to its end (its exit code is
    lost with the server: it reads as killed), and the next run starts a new server and is forked from
    it. The module's last test of the server: it leaves the new one to the fixture."""
    config = make_config(name="orphan", max_steps=10_000)
    run = forked(forks, write_run(config, tmp_path), tmp_path / "orphan.log")
    assert forks.pid is not None
    os.kill(forks.pid, signal.SIGKILL)
    time.sleep(0.5)
    assert run.poll() is None  # still training, no longer anyone's to report
    os.kill(run.pid, signal.SIGTERM)
    assert wait(run) == -signal.SIGKILL
    dead = forks.pid
    again = write_run(make_config(name="again", max_steps=1), tmp_path)
    assert forks.fork(again, tmp_path / "again.log", training_env()) is None  # and a new server starts
    assert forks.pid != dead
    assert wait(forked(forks, again, tmp_path / "again.log")) == EXIT_OK


def test_a_server_that_declines_leaves_every_run_to_a_fresh_process(tmp_path: Path) -> None:
    """A server that says it cannot serve (on a CUDA machine: the driver loaded while importing) is not
    asked again: fork returns None, and the caller starts the run afresh."""
    why = {"ready": False, "why": "CUDA's driver library loaded while importing"}
    forks = ForkServer(command=[sys.executable, "-c", f"print({json.dumps(json.dumps(why))})"])
    forks.start()
    assert forks.wait(timeout=60) and not forks.ready()
    first = forks.pid
    for _ in range(2):
        assert forks.fork(tmp_path / "run.json", tmp_path / "log", training_env()) is None
        forks.start()
    assert forks.pid == first, "a server that declined is not started again"
    forks.close()
