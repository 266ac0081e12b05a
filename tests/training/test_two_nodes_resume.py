"""Two nodes on one machine, killed and stopped: kill -9 of the second node mid-run fails the attempt,
and a new attempt (a new rendezvous, both nodes started again) resumes from the last checkpoint in the
shared job directory to the adapter of an uninterrupted twin, bit for bit; a SIGTERM to node 0 (what
its worker sends on a cancel or pause) stops both nodes after the same step.

The nodes are two torchrun launches as worker.nodes starts them (not two worker processes: the worker
path around them is tested in tests/worker/test_gang_placement.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from core.storage import CHECKPOINTS_DIR
from tests.training.test_split_invariance import SPEC, adapter
from tests.training.test_two_nodes import REPO, TWO_NODES, free_port
from tests.training.util import qa_rows
from training.checkpoint import list_checkpoints
from worker.nodes import Node
from worker.supervision import SHUTDOWN_TIMEOUT_S, training_command

pytestmark = pytest.mark.slow
STOP_BOUND_S = 60  # well inside the reaper's lease (settings.lease_seconds, 120 s)


def nodes(run_json: Path, run_id: str, log: Path) -> list[subprocess.Popen[bytes]]:
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(SHUTDOWN_TIMEOUT_S)}
    out = []
    for rank in (0, 1):
        cmd = training_command(run_json, Node(rank=rank, count=2, endpoint=endpoint, run_id=run_id))
        with log.open("ab") as f:
            out.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT))
    return out


def kill_tree(pid: int) -> None:
    """kill -9 of a process and every process under it (torchrun starts each rank in a session of its
    own, so a process group is not enough; a worker's trainer stops itself when its worker dies)."""
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        p.kill()


def wait_for_checkpoint(out: Path, procs: list[subprocess.Popen[bytes]], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not list_checkpoints(out / CHECKPOINTS_DIR):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.2)


def test_kill_9_of_a_node_resumes_to_the_uninterrupted_adapter(make_config, tmp_path: Path) -> None:
    spec = {**SPEC, **TWO_NODES, "checkpoint_every_steps": 3, "epochs": 2}
    rows = qa_rows(40)  # 2 epochs of 40 examples: 20 steps, killed after the first checkpoint (step 3)
    configs = {name: make_config(rows, name=name, packing=True, **spec) for name in ("killed", "twin")}
    jsons = {}
    for name, c in configs.items():
        jsons[name] = tmp_path / f"{name}.json"
        jsons[name].write_text(c.model_dump_json())
    killed_out = Path(configs["killed"].output_dir)
    log = tmp_path / "nodes.log"
    twin = nodes(jsons["twin"], "twin-1", log)
    first = nodes(jsons["killed"], "killed-1", log)
    wait_for_checkpoint(killed_out, first)
    kill_tree(first[1].pid)  # the second node: its torchrun and its rank, as when its worker dies
    assert first[0].wait(timeout=300) != 0, log.read_text()  # the attempt fails; no half-run adapter
    saved = [p.name for p in list_checkpoints(killed_out / CHECKPOINTS_DIR)]
    second = nodes(jsons["killed"], "killed-2", log)  # the next attempt: a fresh rendezvous
    codes = [p.wait(timeout=600) for p in [*second, *twin]]
    assert codes == [0, 0, 0, 0], log.read_text()[-5000:]
    assert "resum" in log.read_text().lower()
    a, b = adapter(killed_out), adapter(Path(configs["twin"].output_dir))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"\nkilled after {saved}; resumed adapter equal to the twin's in all {len(a)} tensors")


def test_a_stop_of_node_0_stops_both_nodes(make_config, tmp_path: Path) -> None:
    config = make_config(name="stopped", packing=True, **{**SPEC, **TWO_NODES, "epochs": 20})
    run_json = tmp_path / "stopped.json"
    run_json.write_text(config.model_dump_json())
    log = tmp_path / "nodes.log"
    procs = nodes(run_json, "stopped-1", log)
    out = Path(config.output_dir)
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").exists() or '"step"' not in (out / "metrics.jsonl").read_text():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), log.read_text()
        time.sleep(0.2)
    start = time.monotonic()
    procs[0].send_signal(signal.SIGTERM)  # a cancel: node 0's worker signals its torchrun
    codes = [p.wait(timeout=STOP_BOUND_S) for p in procs]
    took = time.monotonic() - start
    print(f"\nSIGTERM to node 0: both nodes exited in {took:.1f} s, codes {codes}")
    assert took < STOP_BOUND_S
    assert '"stopped"' in (out / "metrics.jsonl").read_text(), log.read_text()[-3000:]
