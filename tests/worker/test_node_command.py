"""The torchrun each worker of a multi-node job starts: torchrun's own c10d rendezvous at node 0's
worker, one rendezvous per attempt, a join timeout, no restarts of its own."""

from __future__ import annotations

from pathlib import Path

from core.run_protocol import RunConfig
from core.spec import JobSpec
from worker.nodes import RDZV_JOIN_TIMEOUT_S, Node, rendezvous_id
from worker.supervision import training_command


def run_json(tmp_path: Path, **spec: object) -> Path:
    config = RunConfig(
        job_id="abcdefgh",
        spec=JobSpec(base_model="m", dataset_id="abcdefgh", **spec),
        model_dir="/m",
        dataset_path="/d.jsonl",
        output_dir="/o",
    )
    path = tmp_path / "run.json"
    path.write_text(config.model_dump_json())
    return path


def flags(cmd: list[str]) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in cmd if a.startswith("--") and "=" in a)


def test_each_node_joins_one_c10d_rendezvous_at_node_0(tmp_path: Path) -> None:
    path = run_json(tmp_path, num_gpus=4, num_nodes=2)
    commands = [
        training_command(path, Node(rank=r, count=2, endpoint="gpu-a:29400", run_id=rendezvous_id("j", 3)))
        for r in (0, 1)
    ]
    for rank, cmd in enumerate(commands):
        assert cmd[1:3] == ["-m", "torch.distributed.run"] and cmd[-3:] == ["-m", "training.run", str(path)]
        f = flags(cmd)
        assert f["nnodes"] == "2" and f["node-rank"] == str(rank) and f["nproc-per-node"] == "4"
        assert f["rdzv-backend"] == "c10d" and f["rdzv-endpoint"] == "gpu-a:29400" and f["rdzv-id"] == "j-3"
        assert f["rdzv-conf"] == f"join_timeout={RDZV_JOIN_TIMEOUT_S},is_host={int(rank == 0)}"
        assert f["max-restarts"] == "0" and "--standalone" not in cmd


def test_a_one_node_job_keeps_its_private_rendezvous(tmp_path: Path) -> None:
    cmd = training_command(run_json(tmp_path, num_gpus=2))
    assert "--standalone" in cmd and not any(a.startswith("--rdzv") for a in cmd)
    assert training_command(run_json(tmp_path))[1:3] == ["-m", "training.run"]
