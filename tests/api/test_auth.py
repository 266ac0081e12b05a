"""Tenants and API keys: nobody sees another tenant's data; a missing or wrong key is 401."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from core.settings import Settings
from models import jobs as jobs_db
from models.db import session_scope
from tests.api.conftest import ALPACA


def _job(client: TestClient, dataset_id: str) -> str:
    r = client.post("/jobs", json={"base_model": "tiny", "dataset_id": dataset_id})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def test_missing_or_wrong_key_is_401(app: FastAPI) -> None:
    with TestClient(app) as anonymous:
        for method, path in [("get", "/jobs"), ("get", "/datasets"), ("post", "/jobs"), ("get", "/models")]:
            r = getattr(anonymous, method)(path)
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "unauthorized" and r.headers["WWW-Authenticate"] == "Bearer"
        for bad in ["Bearer nope", "Bearer ftk_000000000000_" + "x" * 32, "Basic abc", "Bearer "]:
            r = anonymous.get("/jobs", headers={"Authorization": bad})
            assert r.status_code == 401, bad
        assert anonymous.get("/health").status_code == 200  # liveness needs no key


def test_other_tenant_gets_404_for_everything(
    client: TestClient, other_client: TestClient, dataset_id: str, app: FastAPI
) -> None:
    job_id = _job(client, dataset_id)
    services = app.state.services
    with session_scope(services.sessions) as s:  # make the adapter "ready" so only ownership can refuse
        jobs_db.claim(s, job_id, "w", 60)
    for path in [
        f"/datasets/{dataset_id}",
        f"/jobs/{job_id}",
        f"/jobs/{job_id}/events",
        f"/jobs/{job_id}/metrics",
        f"/jobs/{job_id}/artifacts",
        f"/jobs/{job_id}/adapter",
    ]:
        r = other_client.get(path)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["code"] in ("job_not_found", "dataset_not_found")
    r = other_client.post(f"/jobs/{job_id}/cancel")
    assert r.status_code == 404
    assert client.get(f"/jobs/{job_id}").json()["cancel_requested"] is False
    # Lists hide them too, and another tenant cannot train on the dataset.
    assert other_client.get("/jobs").json()["data"] == []
    assert other_client.get("/datasets").json()["data"] == []
    r = other_client.post("/jobs", json={"base_model": "tiny", "dataset_id": dataset_id})
    assert r.status_code == 422 and r.json()["error"]["code"] == "dataset_not_found"
    r = other_client.post("/plan", json={"base_model": "tiny", "dataset_id": dataset_id, "gpu": "24GB"})
    assert r.status_code == 200  # planning reveals nothing: the dataset is simply not used


def test_admin_sees_every_tenant(client: TestClient, admin_client: TestClient, dataset_id: str) -> None:
    job_id = _job(client, dataset_id)
    assert [j["id"] for j in admin_client.get("/jobs").json()["data"]] == [job_id]
    assert admin_client.get(f"/jobs/{job_id}").status_code == 200
    assert admin_client.get("/workers").status_code == 200


def test_workers_need_an_admin(client: TestClient) -> None:
    r = client.get("/workers")
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"


def test_active_job_limit_is_429_with_retry_after(
    app: FastAPI, settings: Settings, dataset_id: str, client: TestClient
) -> None:
    app.state.services.settings = settings.model_copy(update={"max_active_jobs_per_tenant": 2})
    _job(client, dataset_id)
    _job(client, dataset_id)
    r = client.post("/jobs", json={"base_model": "tiny", "dataset_id": dataset_id})
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_jobs"
    assert int(r.headers["Retry-After"]) > 0


def test_request_rate_limit(app: FastAPI, client: TestClient) -> None:
    from api.ratelimit import RateLimiter

    app.state.services.rate_limiter = RateLimiter(per_minute=5)
    codes = [client.get("/jobs").status_code for _ in range(8)]
    assert codes[:5] == [200] * 5 and codes[5:] == [429] * 3


def test_storage_quota(app: FastAPI, settings: Settings, client: TestClient) -> None:
    app.state.services.settings = settings.model_copy(
        update={"max_stored_bytes_per_tenant": len(ALPACA) + 10}
    )
    assert client.post("/datasets", files={"file": ("a.jsonl", ALPACA)}).status_code == 201
    r = client.post("/datasets", files={"file": ("a.jsonl", ALPACA)})
    assert r.status_code == 413 and r.json()["error"]["code"] in (
        "storage_quota_exceeded",
        "payload_too_large",
    )


def test_auth_off_is_explicit_dev_mode(settings: Settings) -> None:
    from api.main import create_app

    app = create_app(settings.model_copy(update={"auth": "off"}), enqueue=lambda _: True)
    with TestClient(app) as anonymous:
        assert anonymous.get("/workers").status_code == 200  # everyone is the local admin
    app.state.services.engine.dispose()
