from __future__ import annotations

from fastapi.testclient import TestClient

from tests.api.conftest import RecordingEnqueuer


def test_create_job_is_queued_and_enqueued_after_commit(
    client: TestClient, dataset_id: str, enqueued: RecordingEnqueuer
) -> None:
    r = client.post("/jobs", json={"base_model": "tiny", "dataset_id": dataset_id, "method": "qlora"})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] == "queued" and enqueued.sent == [job["id"]]
    assert job["spec"]["gradient_checkpointing"] is True  # qlora default, resolved in the stored spec
    assert job["progress"] == {
        "step": 0,
        "total_steps": None,
        "percent": None,
        "epoch": None,
        "loss": None,
        "tokens_per_s": None,
        "eta_seconds": None,
    }
    assert client.get(f"/jobs/{job['id']}").json()["id"] == job["id"]
    events = client.get(f"/jobs/{job['id']}/events").json()
    assert [e["kind"] for e in events["data"]] == ["queued"] and not events["has_more"]


def test_unknown_field_is_422_naming_it(client: TestClient, dataset_id: str) -> None:
    r = client.post("/jobs", json={"base_model": "tiny", "dataset_id": dataset_id, "lora_rank": 8})
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and err["param"] == "lora_rank"
    assert "unknown field 'lora_rank'" in err["message"]


def test_all_problems_reported_at_once(client: TestClient) -> None:
    r = client.post("/jobs", json={"base_model": "../etc", "dataset_id": "x", "lora_r": 0, "method": "dora"})
    assert r.status_code == 422
    params = {d["param"] for d in r.json()["error"]["details"]}
    assert params == {"base_model", "dataset_id", "lora_r", "method"}


def test_malformed_json_body(client: TestClient) -> None:
    r = client.post("/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_json"


def test_unknown_base_model(client: TestClient, dataset_id: str) -> None:
    r = client.post("/jobs", json={"base_model": "meta-llama/Llama-3-8B", "dataset_id": dataset_id})
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "base_model"
    assert "never downloads" in err["message"]


def test_unknown_dataset(client: TestClient, enqueued: RecordingEnqueuer) -> None:
    r = client.post("/jobs", json={"base_model": "tiny", "dataset_id": "0123456789abcdef"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "dataset_not_found"
    assert enqueued.sent == []


def test_validation_dataset_must_exist_and_be_the_callers(
    client: TestClient, other_client: TestClient, dataset_id: str, enqueued: RecordingEnqueuer
) -> None:
    spec = {"base_model": "tiny", "dataset_id": dataset_id, "validation_dataset_id": "0123456789abcdef"}
    r = client.post("/jobs", json=spec)
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "dataset_not_found"
    assert r.json()["error"]["param"] == "validation_dataset_id"
    # another tenant's dataset is not found either (its owner may not train or evaluate on it)
    r = other_client.post(
        "/jobs", json={**spec, "dataset_id": dataset_id, "validation_dataset_id": dataset_id}
    )
    assert r.status_code == 422 and r.json()["error"]["code"] == "dataset_not_found"
    both = {**spec, "validation_dataset_id": dataset_id, "validation_fraction": 0.1}
    r = client.post("/jobs", json=both)
    assert r.status_code == 422 and "not both" in r.json()["error"]["message"]
    assert client.post("/jobs", json={**spec, "validation_dataset_id": dataset_id}).status_code == 202
    assert len(enqueued.sent) == 1


def test_merged_download_needs_the_export(client: TestClient, dataset_id: str) -> None:
    job = client.post("/jobs", json={"base_model": "tiny", "dataset_id": dataset_id}).json()
    r = client.get(f"/jobs/{job['id']}/merged")
    assert r.status_code == 409 and r.json()["error"]["code"] == "merged_not_requested"
    job = client.post(
        "/jobs", json={"base_model": "tiny", "dataset_id": dataset_id, "export": "merged"}
    ).json()
    r = client.get(f"/jobs/{job['id']}/merged")
    assert r.status_code == 409 and r.json()["error"]["code"] == "merged_not_ready"


def test_invalid_dataset_cannot_be_used(client: TestClient) -> None:
    bad = client.post("/datasets", files={"file": ("b.jsonl", b"nope\n")}).json()["error"]["details"]["id"]
    r = client.post("/jobs", json={"base_model": "tiny", "dataset_id": bad})
    assert r.status_code == 422 and r.json()["error"]["code"] == "dataset_invalid"
    assert bad in r.json()["error"]["message"]


def test_cancel_queued_then_conflict(client: TestClient, dataset_id: str) -> None:
    job = client.post("/jobs", json={"base_model": "tiny", "dataset_id": dataset_id}).json()
    r = client.post(f"/jobs/{job['id']}/cancel")
    assert r.status_code == 202 and r.json()["status"] == "cancelled"
    r = client.post(f"/jobs/{job['id']}/cancel")
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_finished"


def test_adapter_not_ready_and_unknown_job(client: TestClient, dataset_id: str) -> None:
    job = client.post("/jobs", json={"base_model": "tiny", "dataset_id": dataset_id}).json()
    r = client.get(f"/jobs/{job['id']}/adapter")
    assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_not_ready"
    r = client.get("/jobs/0123456789abcdef")
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"


def test_models_lists_local_only(client: TestClient) -> None:
    assert [m["name"] for m in client.get("/models").json()] == ["tiny"]


def test_health_and_ready_without_broker(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    r = client.get("/ready")
    assert r.status_code == 503 and r.json()["checks"] == {"database": True, "broker": False}


def test_pause_and_resume_a_queued_job(
    client: TestClient, dataset_id: str, enqueued: RecordingEnqueuer
) -> None:
    job_id = client.post("/jobs", json={"base_model": "tiny", "dataset_id": dataset_id}).json()["id"]
    r = client.post(f"/jobs/{job_id}/pause")
    assert r.status_code == 202 and r.json()["status"] == "paused", r.text
    r = client.post(f"/jobs/{job_id}/pause")
    assert r.status_code == 409
    assert r.json()["error"] == {
        "code": "job_not_pausable",
        "message": f"job {job_id} is paused; only a queued or running job can be paused",
        "param": "job_id",
        "details": {"status": "paused", "cancel_requested": False},
    }
    assert client.get("/jobs?status=paused").json()["data"][0]["id"] == job_id
    r = client.post(f"/jobs/{job_id}/resume")
    assert r.status_code == 202 and r.json()["status"] == "queued", r.text
    assert enqueued.sent == [job_id, job_id]  # woken again, after the commit
    r = client.post(f"/jobs/{job_id}/resume")
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_not_paused"
    assert r.json()["error"]["details"] == {"status": "queued"}
    events = client.get(f"/jobs/{job_id}/events").json()["data"]
    assert [e["kind"] for e in events] == ["queued", "paused", "resumed"]
    assert events[1]["message"] == "paused before it started"


def test_a_paused_job_can_be_cancelled_and_then_neither_paused_nor_resumed(
    client: TestClient, dataset_id: str
) -> None:
    job_id = client.post("/jobs", json={"base_model": "tiny", "dataset_id": dataset_id}).json()["id"]
    assert client.post(f"/jobs/{job_id}/pause").status_code == 202
    r = client.post(f"/jobs/{job_id}/cancel")
    assert r.status_code == 202 and r.json()["status"] == "cancelled"
    assert client.post(f"/jobs/{job_id}/pause").json()["error"]["code"] == "job_not_pausable"
    assert client.post(f"/jobs/{job_id}/resume").json()["error"]["code"] == "job_not_paused"
    assert client.post(f"/jobs/{job_id}/cancel").json()["error"]["code"] == "job_finished"
