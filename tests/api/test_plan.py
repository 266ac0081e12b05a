"""The planner at the API: POST /plan answers; POST /jobs refuses what no worker in the fleet can fit."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from core.settings import Settings
from models import workers as workers_db
from models.db import session_scope
from tests.api.conftest import RecordingEnqueuer

LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}
HEAVY = {
    "base_model": "llama-7b",
    "method": "lora",
    "micro_batch_size": 8,
    "max_seq_len": 4096,
    "gradient_checkpointing": False,
}


@pytest.fixture
def seven_b(settings: Settings) -> str:
    d = settings.models_dir / "llama-7b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA2_7B))
    return "llama-7b"


def _register(client: TestClient, worker: str, devices: list[dict[str, object]]) -> None:
    services = client.app.state.services  # type: ignore[attr-defined]
    with session_scope(services.sessions) as s:
        workers_db.register(s, worker, "host", devices)


def test_plan_on_named_gpu(client: TestClient, dataset_id: str, seven_b: str) -> None:
    r = client.post(
        "/plan", json={"base_model": seven_b, "dataset_id": dataset_id, "method": "qlora", "gpu": "A100-80GB"}
    )
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["fits"] and plan["gpu"] == "A100-80GB" and plan["suggestions"] == []
    assert sum(t["bytes"] for t in plan["breakdown"]) == plan["total_bytes"]
    names = {t["name"] for t in plan["breakdown"]}
    assert any("weight" in n for n in names) and all(t["note"] for t in plan["breakdown"])


def test_plan_that_does_not_fit_has_suggestions_that_fit(
    client: TestClient, dataset_id: str, seven_b: str
) -> None:
    r = client.post("/plan", json={**HEAVY, "dataset_id": dataset_id, "gpu": "24GB"})
    assert r.status_code == 200, r.text
    plan = r.json()
    assert not plan["fits"] and plan["suggestions"]
    assert all(s["fits"] and s["plan_total_bytes"] <= plan["usable_bytes"] for s in plan["suggestions"])


def test_unknown_gpu_is_422(client: TestClient, dataset_id: str, seven_b: str) -> None:
    r = client.post("/plan", json={"base_model": seven_b, "dataset_id": dataset_id, "gpu": "Voodoo2"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "gpu"


def test_job_refused_when_no_worker_can_fit_it(
    client: TestClient, dataset_id: str, seven_b: str, enqueued: RecordingEnqueuer
) -> None:
    _register(client, "w-t4", [{"name": "Tesla T4", "kind": "cuda", "memory_bytes": 15360 * 2**20}])
    r = client.post("/jobs", json={**HEAVY, "dataset_id": dataset_id})
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["code"] == "infeasible" and "T4" in err["message"]
    assert err["details"]["breakdown"] and err["details"]["suggestions"]
    assert enqueued.sent == [] and client.get("/jobs").json()["data"] == []
    # The same job with a suggested change is admitted, and its prediction is stored on the job.
    change = err["details"]["suggestions"][0]["change"]
    r = client.post("/jobs", json={**HEAVY, "dataset_id": dataset_id, **change})
    assert r.status_code == 202, r.text
    assert r.json()["predicted_peak_bytes"] > 0


def test_job_admitted_on_the_roomiest_worker(client: TestClient, dataset_id: str, seven_b: str) -> None:
    _register(client, "w-t4", [{"name": "T4", "kind": "declared"}])
    _register(client, "w-h100", [{"name": "H100", "kind": "declared"}])
    r = client.post(
        "/jobs",
        json={**HEAVY, "dataset_id": dataset_id, "gradient_checkpointing": True, "micro_batch_size": 1},
    )
    assert r.status_code == 202, r.text


def test_multi_gpu_job_needs_a_worker_with_that_many(
    client: TestClient, dataset_id: str, seven_b: str
) -> None:
    _register(client, "w1", [{"name": "A100-80GB", "kind": "declared"}])
    r = client.post("/jobs", json={"base_model": seven_b, "dataset_id": dataset_id, "num_gpus": 4})
    assert r.status_code == 422 and r.json()["error"]["param"] == "num_gpus"


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_fsdp_job_admitted_on_a_worker_with_enough_gpus(
    client: TestClient, dataset_id: str, seven_b: str, method: str
) -> None:
    _register(client, "w2", [{"name": "A100-80GB", "kind": "declared"}] * 2)
    r = client.post(
        "/jobs", json={"base_model": seven_b, "dataset_id": dataset_id, "method": method, "num_gpus": 2}
    )
    assert r.status_code == 202, r.text
    assert r.json()["spec"]["num_gpus"] == 2


def test_fsdp_job_with_an_8bit_optimizer_is_refused(
    client: TestClient, dataset_id: str, seven_b: str
) -> None:
    _register(client, "w2", [{"name": "A100-80GB", "kind": "declared"}] * 2)
    job = {"base_model": seven_b, "dataset_id": dataset_id, "num_gpus": 2, "optimizer": "adamw_8bit"}
    r = client.post("/jobs", json=job)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("unsupported_with_fsdp", "optimizer")
    assert "adamw_8bit" in err["message"] and "FSDP" in err["message"]
    assert client.post("/jobs", json={**job, "num_gpus": 1}).status_code == 202


def test_cpu_worker_runs_fsdp_as_processes_sharing_its_ram(client: TestClient, dataset_id: str) -> None:
    _register(client, "cpu", [{"name": "cpu", "kind": "cpu", "memory_bytes": 512 * 2**30}])
    job = {"base_model": "tiny", "dataset_id": dataset_id, "num_gpus": 2}
    r = client.post("/plan", json=job)
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["num_gpus"] == 2 and plan["gpu"] == "cpu"
    assert plan["usable_bytes"] <= 256 * 2**30  # each of the 2 processes has half the RAM
    r = client.post("/jobs", json=job)
    assert r.status_code == 202, r.text
