"""Admission from the data's lengths: a job whose worst case (every micro-batch micro_batch_size x
max_seq_len tokens) does not fit is planned again from its data, measured at admission by the real
`python -m training.token_stats` subprocess, and admitted when that fits; refused when even that does not."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.deps import Services
from core.arch import load_architecture
from core.spec import JobSpec
from models import jobs as jobs_db
from models import workers as workers_db
from models.db import session_scope
from planner import BatchShape
from planner.feasibility import device_gpu, plan_on
from planner.gpus import RESERVE_MIN_BYTES
from training.demo import TINY, build_demo_model

MiB = 2**20
# max_seq_len far above the data's longest example (~40 tokens)
SPEC = {"base_model": "real", "method": "lora", "max_seq_len": 8192, "micro_batch_size": 8, "packing": False}


@pytest.fixture
def real_model(client: TestClient) -> Path:
    services: Services = client.app.state.services  # type: ignore[attr-defined]
    return build_demo_model(services.settings.models_dir, name="real", size=TINY)


def _worker_with(client: TestClient, memory_bytes: int) -> None:
    services: Services = client.app.state.services  # type: ignore[attr-defined]
    with session_scope(services.sessions) as s:
        workers_db.register(
            s, "w-small", "host", [{"kind": "cpu", "name": "cpu", "memory_bytes": memory_bytes}]
        )


def _total(real_model: Path, dataset_id: str, shape: BatchShape | None = None) -> int:
    """The plan's bytes on a CPU worker (the total does not depend on its size); a worker declaring
    RESERVE + n bytes has n usable (planner.gpus)."""
    cpu = device_gpu({"kind": "cpu", "name": "cpu", "memory_bytes": 8 * 2**30})
    spec = JobSpec(**SPEC, dataset_id=dataset_id)
    return plan_on(spec, load_architecture(real_model), cpu, shape=shape).total_bytes


@pytest.mark.slow
def test_a_job_refused_on_its_worst_case_is_admitted_on_its_data(
    client: TestClient, dataset_id: str, real_model: Path
) -> None:
    usable = 1024 * MiB
    assert _total(real_model, dataset_id) > usable  # the worst case would be refused
    _worker_with(client, RESERVE_MIN_BYTES + usable)
    r = client.post("/jobs", json={**SPEC, "dataset_id": dataset_id})
    assert r.status_code == 202, r.text
    job = r.json()
    plan = client.get(f"/jobs/{job['id']}/plan").json()
    assert plan["fits"] and plan["batch_shape"]["tokens"] <= 8 * plan["batch_shape"]["seq_len"] < 8 * 8192
    assert job["predicted_peak_bytes"] == plan["allocated_bytes"]
    services: Services = client.app.state.services  # type: ignore[attr-defined]
    with services.sessions() as s:
        stored = jobs_db.get_job(s, job["id"])
        assert stored is not None and stored.token_stats["status"] == "ready"  # measured: none asked for
        assert stored.token_stats["max_micro_batch_tokens"] == plan["batch_shape"]["tokens"]


@pytest.mark.slow
def test_a_job_that_does_not_fit_even_on_its_data_is_refused_with_the_datas_plan(
    client: TestClient, dataset_id: str, real_model: Path
) -> None:
    # room for the smallest micro-batch, not for five examples of at least 8 tokens each (ALPACA's)
    smallest = _total(real_model, dataset_id, BatchShape(tokens=1, seq_len=1, targets=1))
    short = _total(real_model, dataset_id, BatchShape(tokens=5 * 8, seq_len=8, targets=5))
    assert smallest < short
    _worker_with(client, RESERVE_MIN_BYTES + (smallest + short) // 2)
    r = client.post("/jobs", json={**SPEC, "dataset_id": dataset_id})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "infeasible" and "planned from the data's largest micro-batch" in err["message"]
    assert err["details"]["batch_shape"]["seq_len"] < 8192 and err["details"]["breakdown"]
    assert client.get("/jobs").json()["data"] == []


def test_when_not_even_one_token_fits_nothing_is_measured(client: TestClient, dataset_id: str) -> None:
    _worker_with(
        client, RESERVE_MIN_BYTES + MiB
    )  # the config-only "tiny" model has no tokenizer: measuring would fail
    r = client.post("/jobs", json={**SPEC, "base_model": "tiny", "dataset_id": dataset_id})
    assert r.status_code == 422
    assert "not even one token per sequence would fit" in r.json()["error"]["message"]
