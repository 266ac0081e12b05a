"""Idempotency-Key on POST /jobs and POST /datasets."""

from __future__ import annotations

from fastapi.testclient import TestClient

from models import idempotency as idem
from tests.api.conftest import ALPACA, RecordingEnqueuer, jsonl


def test_same_key_same_body_returns_first_job(
    client: TestClient, dataset_id: str, enqueued: RecordingEnqueuer
) -> None:
    body = {"base_model": "tiny", "dataset_id": dataset_id}
    first = client.post("/jobs", json=body, headers={"Idempotency-Key": "k-1"})
    again = client.post("/jobs", json=body, headers={"Idempotency-Key": "k-1"})
    assert first.status_code == again.status_code == 202
    assert again.json()["id"] == first.json()["id"] and again.headers["Idempotent-Replayed"] == "true"
    assert len(client.get("/jobs").json()["data"]) == 1 and enqueued.sent == [first.json()["id"]]


def test_same_key_different_body_is_422(client: TestClient, dataset_id: str) -> None:
    client.post(
        "/jobs", json={"base_model": "tiny", "dataset_id": dataset_id}, headers={"Idempotency-Key": "k"}
    )
    r = client.post(
        "/jobs",
        json={"base_model": "tiny", "dataset_id": dataset_id, "lora_r": 4},
        headers={"Idempotency-Key": "k"},
    )
    assert r.status_code == 422 and r.json()["error"]["code"] == "idempotency_key_reused"


def test_key_in_flight_is_409(client: TestClient, dataset_id: str) -> None:
    services = client.app.state.services  # type: ignore[attr-defined]
    tenant = client.get(f"/datasets/{dataset_id}").json()["tenant_id"]
    claimed = idem.claim(services.sessions, f"{tenant} POST /jobs", "busy", "h")
    assert isinstance(claimed, idem.Owner)  # another request holds it
    r = client.post(
        "/jobs", json={"base_model": "tiny", "dataset_id": dataset_id}, headers={"Idempotency-Key": "busy"}
    )
    assert r.status_code == 409 and r.json()["error"]["code"] == "idempotency_key_in_flight"


def test_failed_request_releases_its_key(client: TestClient, dataset_id: str) -> None:
    r = client.post(
        "/jobs", json={"base_model": "nope", "dataset_id": dataset_id}, headers={"Idempotency-Key": "x"}
    )
    assert r.status_code == 422
    r = client.post(
        "/jobs", json={"base_model": "tiny", "dataset_id": dataset_id}, headers={"Idempotency-Key": "x"}
    )
    assert r.status_code == 202


def test_upload_idempotency(client: TestClient) -> None:
    files = {"file": ("a.jsonl", ALPACA)}
    first = client.post("/datasets", files=files, headers={"Idempotency-Key": "u1"})
    again = client.post("/datasets", files=files, headers={"Idempotency-Key": "u1"})
    assert first.status_code == again.status_code == 201 and again.json()["id"] == first.json()["id"]
    assert len(client.get("/datasets").json()["data"]) == 1
    other = {"file": ("a.jsonl", jsonl({"text": "different"}))}
    r = client.post("/datasets", files=other, headers={"Idempotency-Key": "u1"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "idempotency_key_reused"
