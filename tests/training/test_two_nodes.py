"""Two nodes on one machine: a num_nodes 2 job launched as two torchrun nodes (worker.nodes: c10d
rendezvous on 127.0.0.1, one gloo rank each) trains the adapter one process trains from the same global
batch, packed and padded. A run of half the global batch is the control: it must differ."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from core.run_protocol import EXIT_OK
from tests.training.test_split_invariance import SPEC, adapter, losses
from tests.training.util import elementwise, qa_rows, relative_difference
from training.run import run
from worker.nodes import Node
from worker.supervision import training_command

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
TWO_NODES = {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "num_nodes": 2}
ONE_PROCESS = {"micro_batch_size": 4, "gradient_accumulation_steps": 1}
CONTROL = {"micro_batch_size": 2, "gradient_accumulation_steps": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_nodes(run_json: Path, run_id: str, log_dir: Path) -> list[subprocess.Popen[str]]:
    """Both nodes of a 2-node run, as two workers start them: the same run.json, one rendezvous."""
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for rank in (0, 1):
        cmd = training_command(run_json, Node(rank=rank, count=2, endpoint=endpoint, run_id=run_id))
        log = (log_dir / f"node{rank}.log").open("w")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs.append(
            subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        )
    return procs


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_two_nodes_train_what_one_process_trains(make_config, tmp_path: Path, packing: bool) -> None:
    rows = qa_rows(22)
    two = make_config(rows, name="nodes", packing=packing, **SPEC, **TWO_NODES)
    one = make_config(rows, name="one", packing=packing, **SPEC, **ONE_PROCESS)
    control = make_config(rows, name="control", packing=packing, **SPEC, **CONTROL)
    run_json = tmp_path / "nodes.json"
    run_json.write_text(two.model_dump_json())
    start = time.monotonic()
    nodes = start_nodes(run_json, "nodes-1", tmp_path)
    assert run(one) == EXIT_OK and run(control) == EXIT_OK  # while the two nodes train
    codes = [p.wait(timeout=600) for p in nodes]
    logs = "\n".join((tmp_path / f"node{r}.log").read_text() for r in (0, 1))
    assert codes == [0, 0], logs
    assert "FSDP over 2 processes" in logs

    ref, out = Path(one.output_dir), Path(two.output_dir)
    assert len(losses(ref)) >= 6
    assert losses(out) == pytest.approx(losses(ref), rel=1e-5)
    diff = relative_difference(adapter(ref), adapter(out))
    worst = elementwise(adapter(ref), adapter(out))
    half = relative_difference(adapter(ref), adapter(Path(control.output_dir)))
    print(f"\n{'packed' if packing else 'padded'}: 2 nodes vs one process: Frobenius {diff:.1e} "
          f"(elementwise {worst:.1e}); control {half:.1e}; {time.monotonic() - start:.0f} s")  # fmt: skip
    assert diff <= 1e-4
    assert half > 1e-2
