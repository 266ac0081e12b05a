"""A local service that heals: under `ftune up`, kill -9 of the worker process and of its training child.
The service stays up, a new worker is running within seconds, and the job finishes from its checkpoint
with the same adapter as an uninterrupted twin (well before the dead worker's lease would have expired)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.stack import REPO, Up, api, download_adapter, training_pid, upload, wait_finished

pytestmark = pytest.mark.slow
SPEC = {
    "base_model": "ftune-demo",
    "method": "lora",
    "max_seq_len": 96,
    "micro_batch_size": 4,
    "max_steps": 12,
    "checkpoint_every_steps": 3,
    "lora_dropout": 0.0,
    "learning_rate": 1e-3,
}


def _children(pid: int) -> dict[int, str]:
    """The direct children of `pid` and their command lines."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(") ", 1)[1].split()[1]) == pid:
            out[int(entry.name)] = cmdline
    return out


def _training_worker(up: Up) -> int | None:
    found = [p for p, cmd in _children(up.proc.p.pid).items() if " worker" in cmd and "--queue" not in cmd]
    return found[0] if len(found) == 1 else None


def _events(base: str, job_id: str) -> list[dict]:
    return list(api.get(f"{base}/jobs/{job_id}/events?limit=500").json()["data"])


def test_kill_9_of_the_worker_under_ftune_up(up: Up, tmp_path: Path) -> None:
    # `up` keeps the default lease (120 s): the job must come back because the new worker releases it
    base = up.base
    try:
        ds = upload(base, REPO / "examples" / "alpaca_small.jsonl")["id"]
        twin = api.post(f"{base}/jobs", json={**SPEC, "dataset_id": ds}).json()["id"]
        wait_finished(base, [twin], timeout=600)
        job_id = api.post(f"{base}/jobs", json={**SPEC, "dataset_id": ds}).json()["id"]
        deadline = time.monotonic() + 300
        while not any(e["kind"] == "checkpoint_saved" for e in _events(base, job_id)):
            assert time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.1)
        worker = _training_worker(up)
        assert worker is not None, _children(up.proc.p.pid)
        child = training_pid(job_id)
        os.kill(worker, signal.SIGKILL)
        os.kill(child, signal.SIGKILL)
        killed = time.monotonic()
        while (new := _training_worker(up)) in (None, worker):
            assert time.monotonic() - killed < 10, "no new worker"
            assert api.get(f"{base}/health").status_code == 200  # the service stays up meanwhile
            time.sleep(0.1)
        print(f"new worker {new} {time.monotonic() - killed:.1f} s after the kill")
        wait_finished(base, [job_id], timeout=300)
        assert time.monotonic() - killed < 120, "came back only when the lease expired"
        job = api.get(f"{base}/jobs/{job_id}").json()
        assert job["status"] == "succeeded" and job["attempt"] == 2, job
        started = [e for e in _events(base, job_id) if e["kind"] == "training_started"]
        assert started[-1]["data"]["resumed_from_step"] > 0, started
        assert up.proc.p.poll() is None and "worker exited with code -9; restarting" in up.log.read_text()
        a = load_file(download_adapter(base, twin, tmp_path) / "adapter_model.safetensors")
        b = load_file(download_adapter(base, job_id, tmp_path) / "adapter_model.safetensors")
        assert a.keys() == b.keys()
        for k in a:
            assert torch.allclose(a[k], b[k], atol=1e-5, rtol=0), k
    except BaseException:
        print(up.tail())
        raise
