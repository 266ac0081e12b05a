"""Tenants and API keys: nobody sees another tenant's data; a missing or wrong key is 401."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from core.run_protocol import StepRecord, encode
from core.settings import Settings
from core.states import JobStatus
from core.storage import new_id
from models import jobs as jobs_db
from models.db import session_scope
from models.tenants import revoke_key
from tests.api.conftest import ALPACA, new_key


def _job(client: TestClient, dataset_id: str) -> str:
    r = client.post("/jobs", json={"base_model": "tiny", "dataset_id": dataset_id})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def _operations(app: FastAPI, ids: dict[str, str]) -> list[tuple[str, str]]:
    """Every (method, path) of the OpenAPI document, path parameters filled with real ids."""
    ops = []
    for path, item in app.openapi()["paths"].items():
        for method in item:
            ops.append((method, path.format(**ids)))
    return ops


PUBLIC = {"/health", "/ready"}


def test_missing_or_wrong_key_is_401_on_every_route(
    app: FastAPI, client: TestClient, dataset_id: str
) -> None:
    ids = {"job_id": _job(client, dataset_id), "dataset_id": dataset_id, "artifact_id": new_id()}
    ids["pull_id"] = new_id()  # GET /models/pulls/{pull_id}: the key is checked before the id
    ids["file_id"] = dataset_id  # /v1/files: the same rows
    ids["step"] = "1"  # GET /jobs/{job_id}/checkpoints/{step}
    ids["model"] = "tiny"  # GET /v1/models/{model}
    ids["webhook_id"] = "wh_0"  # DELETE /webhooks/{webhook_id}, its secret rotation and deliveries
    revoked = new_key(app, "acme")
    assert client.get("/jobs", headers=revoked).status_code == 200
    with session_scope(app.state.services.sessions) as s:
        assert revoke_key(s, revoked["Authorization"].split("_")[1])  # by its id
    wrong_secret = {"Authorization": revoked["Authorization"][:-4] + "AAAA"}
    bad_headers: list[dict[str, str]] = [
        {},
        {"Authorization": "Bearer nope"},
        {"Authorization": "Bearer ftk_000000000000_" + "x" * 32},  # well-formed, unknown
        {"Authorization": "Basic abc"},
        {"Authorization": "Bearer "},
        {"Authorization": "bearer"},
        wrong_secret,
        revoked,
    ]
    ops = _operations(app, ids)
    assert len(ops) >= 12
    with TestClient(app) as anonymous:
        for method, path in ops:
            if path in PUBLIC:
                continue
            for headers in bad_headers:
                r = anonymous.request(method, path, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.json()["error"]["code"] == "unauthorized"
                assert r.headers["WWW-Authenticate"] == "Bearer"
        assert anonymous.get("/health").status_code == 200  # liveness needs no key
    # Nothing was done on the way: the job is untouched and no dataset was added.
    assert client.get(f"/jobs/{ids['job_id']}").json()["status"] == "queued"
    assert len(client.get("/datasets").json()["data"]) == 1


def _succeeded_job(app: FastAPI, client: TestClient, dataset_id: str) -> str:
    """A job as a worker leaves it: trained, with metrics, a checkpoint and a downloadable adapter."""
    job_id = _job(client, dataset_id)
    storage = app.state.services.storage
    (storage.job_dir(job_id) / "checkpoints" / "step-1").mkdir(parents=True)
    step = StepRecord(step=1, total_steps=1, epoch=1.0, loss=2.5, lr=1e-4, tokens=10, elapsed_s=1.0)
    storage.metrics_path(job_id).write_text(encode(step) + "\n")
    storage.adapter_archive(job_id).write_bytes(b"adapter bytes")
    with session_scope(app.state.services.sessions) as s:
        attempt = jobs_db.claim(s, job_id=job_id, worker_id="w", lease_seconds=60)
        assert attempt is not None
        jobs_db.add_artifact(s, new_id(), job_id, "checkpoint", "checkpoints/step-1", 1, "0" * 64, 1)
        jobs_db.add_artifact(s, new_id(), job_id, "adapter", "adapter.tar.gz", 13, "1" * 64, 1)
        assert jobs_db.finish(s, job_id=job_id, attempt=attempt, dst=JobStatus.SUCCEEDED, message="done")
    return job_id


def test_other_tenant_gets_404_for_everything(
    client: TestClient, other_client: TestClient, dataset_id: str, app: FastAPI
) -> None:
    done = _succeeded_job(app, client, dataset_id)
    queued = _job(client, dataset_id)
    missing = new_id()
    reads = {
        "/datasets/{id}": dataset_id,
        "/jobs/{id}": done,
        "/jobs/{id}/events": done,
        "/jobs/{id}/metrics": done,
        "/jobs/{id}/artifacts": done,  # the checkpoints are artifacts
        "/jobs/{id}/adapter": done,
    }
    for template, owned in reads.items():
        mine = client.get(template.format(id=owned))
        assert mine.status_code == 200, (template, mine.text)  # so only ownership can refuse below
        theirs = other_client.get(template.format(id=owned))
        absent = other_client.get(template.format(id=missing))
        assert theirs.status_code == absent.status_code == 404, (template, theirs.text)
        # Exactly like an id that does not exist: nothing tells the two apart.
        assert theirs.json()["error"] == {
            **absent.json()["error"],
            "message": absent.json()["error"]["message"].replace(missing, owned),
        }
    assert len(client.get(f"/jobs/{done}/artifacts").json()) == 2
    assert client.get(f"/jobs/{done}/adapter").content == b"adapter bytes"
    # Cancel, pause, resume: 404 for a queued job (left untouched) and a finished one (not a telling 409).
    for job_id in (queued, done):
        for action in ("cancel", "pause", "resume"):
            r = other_client.post(f"/jobs/{job_id}/{action}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found", action
    job = client.get(f"/jobs/{queued}").json()
    assert job["status"] == "queued" and job["cancel_requested"] is False
    # Lists hide them, with any filter and page size.
    for path in ["/jobs", "/jobs?status=queued", "/jobs?status=succeeded", "/datasets", "/jobs?limit=1"]:
        assert other_client.get(path).json()["data"] == [], path
    assert len(client.get("/jobs").json()["data"]) == 2
    # Another tenant cannot train on the dataset, nor see it through the planner.
    r = other_client.post("/jobs", json={"base_model": "tiny", "dataset_id": dataset_id})
    assert r.status_code == 422 and r.json()["error"]["code"] == "dataset_not_found"
    r = other_client.post("/plan", json={"base_model": "tiny", "dataset_id": dataset_id, "gpu": "24GB"})
    assert r.status_code == 200  # planning reveals nothing: the dataset is simply not used


def test_idempotency_keys_are_per_tenant(
    client: TestClient, other_client: TestClient, dataset_id: str
) -> None:
    body = {"base_model": "tiny", "dataset_id": dataset_id}
    key = {"Idempotency-Key": "shared-key"}
    assert client.post("/jobs", json=body, headers=key).status_code == 202
    r = other_client.post("/jobs", json=body, headers=key)  # must not replay the first tenant's job
    assert r.status_code == 422 and r.json()["error"]["code"] == "dataset_not_found"
    r = other_client.post("/datasets", files={"file": ("a.jsonl", ALPACA)}, headers=key)
    assert (
        r.status_code == 201
        and r.json()["tenant_id"] != client.get("/datasets").json()["data"][0]["tenant_id"]
    )


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


def test_cli_creates_and_revokes_keys(app: FastAPI, settings: Settings) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("FTUNE_")}
    env |= {"FTUNE_DATABASE_URL": settings.resolved_database_url, "FTUNE_DATA_DIR": str(settings.data_dir)}

    def ftune(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cli", *args], env=env, capture_output=True, text=True)

    out = ftune("keys", "create", "--tenant", "initech")
    assert out.returncode == 0, out.stderr
    key = out.stdout.split()[-1]
    with TestClient(app, headers={"Authorization": f"Bearer {key}"}) as c:
        assert c.get("/jobs").status_code == 200
        assert ftune("keys", "revoke", key).returncode == 0
        assert c.get("/jobs").status_code == 401
    assert ftune("keys", "revoke", "ftk_000000000000_" + "x" * 32).returncode == 1
