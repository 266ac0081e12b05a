"""Job files in the tenant's storage quota (planner.job_files, models.job_files): a job whose checkpoints,
adapter and merged export would not fit is refused at POST /jobs and /v1 create (413
storage_quota_exceeded, naming the fields to change); an admitted job's reservation counts for the
tenant's next jobs and uploads; a finished job counts what its files take, a deleted one nothing; a
checkpoint download streams without a copy on the data volume. Real database, in-process app."""

from __future__ import annotations

import io
import shutil
import tarfile
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from core.arch import load_architecture
from core.settings import Settings
from core.spec import JobSpec
from core.states import JobStatus
from models import jobs as jobs_db
from models import tenants as tenants_db
from models.db import session_scope
from planner import job_files
from tests.api.conftest import ALPACA

SPEC: dict[str, Any] = {"base_model": "tiny", "method": "lora"}


def _files(settings: Settings, dataset_id: str, **fields: Any) -> job_files.Projection:
    """What admission reserves for such a job: its files at their most (ALPACA has 5 examples)."""
    arch = load_architecture(settings.models_dir / "tiny")
    return job_files.project(JobSpec(**SPEC, dataset_id=dataset_id, **fields), arch, 5)


def _quota(app: FastAPI, settings: Settings, quota: int) -> None:
    app.state.services.settings = settings.model_copy(update={"max_stored_bytes_per_tenant": quota})


def _used(app: FastAPI, tenant: str = "acme") -> int:
    """What counts in the tenant's storage quota now."""
    with session_scope(app.state.services.sessions) as s:
        return tenants_db.stored_bytes(s, tenants_db.get_or_create_tenant(s, tenant).id)


def test_a_job_whose_files_would_pass_the_quota_is_refused_naming_the_fields_to_change(
    app: FastAPI, settings: Settings, client: TestClient, dataset_id: str
) -> None:
    three, one = (_files(settings, dataset_id, keep_checkpoints=k) for k in (3, 1))
    assert three.total > one.total
    quota = len(ALPACA) + one.total
    _quota(app, settings, quota)
    r = client.post("/jobs", json={**SPEC, "dataset_id": dataset_id, "keep_checkpoints": 3})
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "storage_quota_exceeded" and error["param"] == "keep_checkpoints"
    assert "keep_checkpoints" in error["message"] and "lora_r" in error["message"]
    assert error["details"]["job_bytes"] == three.total and error["details"]["quota_bytes"] == quota
    assert error["details"]["used_bytes"] == len(ALPACA)
    assert error["details"]["breakdown"]["checkpoints"] == three.checkpoints * three.checkpoint_bytes
    assert client.get("/jobs").json()["data"] == []  # nothing stored

    merged = client.post("/jobs", json={**SPEC, "dataset_id": dataset_id, "export": "merged"})
    assert merged.status_code == 413 and merged.json()["error"]["param"] == "export"
    assert 'set export to "adapter"' in merged.json()["error"]["message"]

    r = client.post("/jobs", json={**SPEC, "dataset_id": dataset_id, "keep_checkpoints": 1})
    assert r.status_code == 202, r.text


def test_v1_create_is_refused_alike(
    app: FastAPI, settings: Settings, client: TestClient, dataset_id: str
) -> None:
    three, one = (_files(settings, dataset_id, keep_checkpoints=k) for k in (3, 1))
    _quota(app, settings, len(ALPACA) + (one.total + three.total) // 2)  # /v1's epochs may differ a little
    body = {"model": "tiny", "training_file": dataset_id, "keep_checkpoints": 3}
    r = client.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "storage_quota_exceeded" and error["type"] == "invalid_request_error"
    assert "keep_checkpoints" in error["message"]
    r = client.post("/v1/fine_tuning/jobs", json={**body, "keep_checkpoints": 1})
    assert r.status_code == 200, r.text


def test_an_admitted_jobs_reservation_counts_for_the_next_job_and_upload(
    app: FastAPI, settings: Settings, client: TestClient, other_client: TestClient, dataset_id: str
) -> None:
    files = _files(settings, dataset_id, keep_checkpoints=1)
    _quota(app, settings, 2 * len(ALPACA) + files.total + 10)
    job = {**SPEC, "dataset_id": dataset_id, "keep_checkpoints": 1}
    assert client.post("/jobs", json=job).status_code == 202
    assert _used(app) == len(ALPACA) + files.total
    r = client.post("/jobs", json=job)
    assert r.status_code == 413 and r.json()["error"]["code"] == "storage_quota_exceeded"
    # the room left is one more upload, not a job's worth
    assert client.post("/datasets", files={"file": ("b.jsonl", ALPACA)}).status_code == 201
    r = client.post("/datasets", files={"file": ("c.jsonl", ALPACA)})  # cut off at the 10 bytes left
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    # another tenant's quota is its own
    assert other_client.post("/datasets", files={"file": ("a.jsonl", ALPACA)}).status_code == 201


def test_a_finished_job_counts_what_its_files_take_and_a_deleted_one_nothing(
    app: FastAPI, settings: Settings, client: TestClient, dataset_id: str
) -> None:
    files = _files(settings, dataset_id, keep_checkpoints=1)
    _quota(app, settings, len(ALPACA) + files.total)
    job_id = client.post("/jobs", json={**SPEC, "dataset_id": dataset_id, "keep_checkpoints": 1}).json()["id"]
    services = app.state.services
    ckpt = services.storage.checkpoints_dir(job_id) / "step-00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "adapter.safetensors").write_bytes(b"w" * 1000)
    with session_scope(services.sessions) as s:
        attempt = jobs_db.claim(s, job_id=job_id, worker_id="w1", lease_seconds=60)
        assert attempt is not None
        jobs_db.finish(s, job_id=job_id, attempt=attempt, dst=JobStatus.SUCCEEDED, message="done")
    assert _used(app) == len(ALPACA) + files.total  # until measured: its reservation

    # the next quota decision measures it: 1000 bytes (and none for serving: no final adapter here)
    assert client.post("/datasets", files={"file": ("b.jsonl", ALPACA)}).status_code == 201
    assert _used(app) == 2 * len(ALPACA) + 1000
    with session_scope(services.sessions) as s:
        assert jobs_db.get_job(s, job_id).files_bytes == 1000  # type: ignore[union-attr]

    assert client.delete(f"/jobs/{job_id}").status_code in (200, 204)
    assert _used(app) == 2 * len(ALPACA)


def test_a_checkpoint_download_streams_without_a_copy_on_the_data_volume(
    app: FastAPI, client: TestClient, dataset_id: str
) -> None:
    job_id = client.post("/jobs", json={**SPEC, "dataset_id": dataset_id}).json()["id"]
    services = app.state.services
    ckpt = services.storage.checkpoints_dir(job_id) / "step-00000004"
    ckpt.mkdir(parents=True)
    for name in ("adapter.safetensors", "optimizer.safetensors"):
        (ckpt / name).write_bytes(b"z" * 200_000)
    with session_scope(services.sessions) as s:
        jobs_db.add_artifact(s, "a" * 32, job_id, "checkpoint", "checkpoints/step-00000004", 1, "f" * 64, 4)
    # No room for a copy: the data volume's temporary folder cannot be written (a file stands there)
    tmp = services.storage.root / "tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.write_bytes(b"")
    r = client.get(f"/jobs/{job_id}/artifacts/{'a' * 32}/download")
    assert r.status_code == 200, r.text
    assert r.headers["x-checksum-sha256"] == "f" * 64 and r.headers["content-disposition"].endswith(
        '.tar.gz"'
    )
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        member = tar.extractfile("step-00000004/optimizer.safetensors")
        assert member is not None and member.read() == b"z" * 200_000
