"""The dashboard's JSON: summary, stored plan, artifact downloads and /metrics, with tenant scoping.

The live paths (SSE, pagination while training, the page in a browser) run on real processes in
tests/e2e/test_dashboard.py.
"""

from __future__ import annotations

import io
import json
import re
import tarfile

from fastapi.testclient import TestClient

from api.deps import Services
from core.run_protocol import EvalRecord, StepRecord, encode
from core.settings import Settings
from core.storage import new_id
from models import jobs as jobs_db
from models import workers as workers_db
from models.db import session_scope
from tests.api.test_plan import LLAMA2_7B

ERROR_KEYS = {"code", "message", "param", "details"}


def _submit(client: TestClient, dataset_id: str, model: str = "tiny") -> str:
    r = client.post("/jobs", json={"base_model": model, "dataset_id": dataset_id, "method": "qlora"})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def _services(client: TestClient) -> Services:
    return client.app.state.services  # type: ignore[attr-defined,no-any-return]


def whole_page(anonymous: TestClient) -> str:
    """The page and every script and style sheet it names, as a browser loads them (no key)."""
    page = anonymous.get("/dashboard")
    assert page.status_code == 200
    parts = re.findall(r'(?:src|href)="(/dashboard/static/[^"]+)"', page.text)
    assert len(parts) >= 2
    texts = [page.text]
    for url in parts:
        r = anonymous.get(url)
        assert r.status_code == 200, url
        assert r.headers["content-type"].startswith("text/css" if url.endswith(".css") else "text/javascript")
        texts.append(r.text)
    return "\n".join(texts)


def test_page_is_public_but_its_data_needs_a_key(client: TestClient) -> None:
    page = whole_page(TestClient(client.app))
    assert "API key needed" in page
    assert "Authorization" in page and "localStorage" in page
    r = TestClient(client.app).get("/dashboard/summary")
    assert r.status_code == 401 and set(r.json()["error"]) == ERROR_KEYS


def test_summary_counts_only_the_callers_jobs_and_shows_workers_to_admins(
    client: TestClient, other_client: TestClient, admin_client: TestClient, dataset_id: str
) -> None:
    job_id = _submit(client, dataset_id)
    with session_scope(_services(client).sessions) as s:
        workers_db.register(s, "w1", "host", [{"name": "A100-80GB", "kind": "declared"}])
        workers_db.set_current_job(s, "w1", job_id)
    mine = client.get("/dashboard/summary").json()
    assert mine["counts"]["queued"] == 1 and mine["queue_depth"] == 1 and mine["counts"]["running"] == 0
    assert mine["is_admin"] is False and mine["workers"] is None and mine["tenants"] is None
    theirs = other_client.get("/dashboard/summary").json()
    assert theirs["counts"]["queued"] == 0 and theirs["queue_depth"] == 0
    ops = admin_client.get("/dashboard/summary").json()
    assert ops["counts"]["queued"] == 1 and "acme" in ops["tenants"].values()
    [w] = ops["workers"]
    assert w["id"] == "w1" and w["alive"] and w["current_job_id"] == job_id


def test_plan_is_stored_at_admission_and_scoped(
    client: TestClient, other_client: TestClient, dataset_id: str, settings: Settings
) -> None:
    unplanned = _submit(client, dataset_id)  # no worker has reported devices yet
    r = client.get(f"/jobs/{unplanned}/plan")
    assert r.status_code == 404 and r.json()["error"]["code"] == "plan_not_found"

    (settings.models_dir / "llama-7b").mkdir()
    (settings.models_dir / "llama-7b" / "config.json").write_text(json.dumps(LLAMA2_7B))
    with session_scope(_services(client).sessions) as s:
        workers_db.register(s, "w1", "host", [{"name": "A100-80GB", "kind": "declared"}])
    job_id = _submit(client, dataset_id, "llama-7b")
    plan = client.get(f"/jobs/{job_id}/plan").json()
    job = client.get(f"/jobs/{job_id}").json()
    assert plan["gpu"] == "A100-80GB" and plan["allocated_bytes"] == job["predicted_peak_bytes"]
    assert sum(t["bytes"] for t in plan["breakdown"]) == plan["total_bytes"]
    r = other_client.get(f"/jobs/{job_id}/plan")
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"


def test_checkpoint_download_is_a_tarball_of_the_directory(
    client: TestClient, other_client: TestClient, dataset_id: str
) -> None:
    job_id = _submit(client, dataset_id)
    services = _services(client)
    ckpt = services.storage.job_dir(job_id) / "checkpoints" / "step-00000004"
    ckpt.mkdir(parents=True)
    (ckpt / "adapter_model.safetensors").write_bytes(b"weights")
    with session_scope(services.sessions) as s:
        jobs_db.add_artifact(s, "a" * 32, job_id, "checkpoint", "checkpoints/step-00000004", 7, "f" * 64, 4)
    listed = client.get(f"/jobs/{job_id}/artifacts").json()
    assert [a["id"] for a in listed] == ["a" * 32]

    url = f"/jobs/{job_id}/artifacts/{'a' * 32}/download"
    r = client.get(url)
    assert r.status_code == 200 and r.headers["x-checksum-sha256"] == "f" * 64
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        member = tar.extractfile("step-00000004/adapter_model.safetensors")
        assert member is not None and member.read() == b"weights"
    assert not list((services.storage.root / "tmp").iterdir()), "the temporary tarball was left behind"

    r = other_client.get(url)
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"
    r = client.get(f"/jobs/{job_id}/artifacts/{'b' * 32}/download")
    assert r.status_code == 404 and r.json()["error"]["code"] == "artifact_not_found"
    for f in ckpt.iterdir():
        f.unlink()
    ckpt.rmdir()  # pruned by training's keep-last-N
    r = client.get(url)
    assert r.status_code == 404 and r.json()["error"]["code"] == "artifact_gone"


def test_artifacts_list_what_is_stored_checkpoints_newest_first_with_their_loss(
    client: TestClient, dataset_id: str
) -> None:
    """The dashboard's list: a checkpoint pruned by keep_checkpoints is gone from it (its row stays)."""
    job_id = _submit(client, dataset_id)
    storage = _services(client).storage
    records = [
        StepRecord(step=n, total_steps=6, epoch=n / 6, loss=3.0 - n / 10, lr=1e-4, tokens=8, elapsed_s=n)
        for n in range(1, 7)
    ]
    records.append(EvalRecord(step=4, eval_loss=2.75))
    storage.job_dir(job_id).mkdir(parents=True)
    storage.metrics_path(job_id).write_text("".join(encode(r) + "\n" for r in records))
    ids = {}
    with session_scope(_services(client).sessions) as s:
        for step in (2, 6, 4):  # rows in no particular order; step 2's directory was pruned
            rel = f"checkpoints/step-{step:08d}"
            if step != 2:
                (storage.job_dir(job_id) / rel).mkdir(parents=True)
            ids[step] = jobs_db.add_artifact(s, new_id(), job_id, "checkpoint", rel, 1, "0" * 64, step).id
        storage.adapter_archive(job_id).write_bytes(b"adapter")
        adapter = jobs_db.add_artifact(s, new_id(), job_id, "adapter", "adapter.tar.gz", 7, "1" * 64, 6).id
    listed = client.get(f"/jobs/{job_id}/artifacts").json()
    assert [(a["id"], a["step"]) for a in listed] == [(adapter, 6), (ids[6], 6), (ids[4], 4)]
    assert [(a["loss"], a["eval_loss"]) for a in listed] == [(None, None), (2.4, None), (2.6, 2.75)]
    for a in listed:
        assert a["download_url"] == f"/jobs/{job_id}/artifacts/{a['id']}/download"
        assert client.get(a["download_url"]).status_code == 200


def test_metrics_need_an_admin_and_label_latency_by_route_template(
    client: TestClient, admin_client: TestClient, dataset_id: str
) -> None:
    job_id = _submit(client, dataset_id)
    client.get(f"/jobs/{job_id}")
    r = client.get("/metrics")
    assert r.status_code == 403 and set(r.json()["error"]) == ERROR_KEYS
    r = admin_client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'ftune_jobs{status="queued"} 1.0' in text and "ftune_queue_depth 1.0" in text
    assert 'ftune_jobs{status="succeeded"} 0.0' in text
    assert re.search(r'ftune_http_request_duration_seconds_count\{.*route="/jobs/\{job_id\}".*\} 1\.0', text)
    assert job_id not in text  # ids never become labels of the latency histogram
    assert 'route="unmatched"' not in text
    admin_client.get("/no/such/path")
    assert 'route="unmatched"' in admin_client.get("/metrics").text


def test_only_the_pages_own_files_are_served(client: TestClient) -> None:
    anonymous = TestClient(client.app)
    for name in ("nope.js", "..%2Fdeps.py", "..%2F..%2Fpyproject.toml", "%2Fetc%2Fpasswd", "dashboard.html"):
        r = anonymous.get(f"/dashboard/static/{name}")
        assert r.status_code == 404, (name, r.text)


def test_the_status_filter_offers_every_status(client: TestClient) -> None:
    from core.states import JobStatus

    page = whole_page(TestClient(client.app))
    select = page[page.index("<option") : page.index("</select>", page.index("<option"))]
    offered = set(re.findall(r"<option>(\w+)</option>", select))
    assert offered == {s.value for s in JobStatus}
    assert all(f".{s.value}" in page for s in JobStatus)  # each status has its badge colour
