"""GET /jobs/{id} says why a queued multi-node job waits: how many of the workers it fits have room now,
and what is missing (a busy worker, or workers the fleet lacks). Real API and database."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from core.states import JobStatus
from models import jobs as jobs_db
from models import workers as workers_db
from models.db import session_scope

GiB = 2**30
CPU_1T = [{"name": "cpu", "kind": "cpu", "memory_bytes": 1024 * GiB}]


def queue_of(client: TestClient, job_id: str) -> dict[str, object]:
    job = client.get(f"/jobs/{job_id}").json()
    assert job["status"] == "queued"
    return dict(job["queue"])


def test_a_two_node_job_says_how_many_workers_have_room_and_what_is_missing(
    app: FastAPI, client: TestClient, dataset_id: str
) -> None:
    sessions = app.state.services.sessions
    with session_scope(sessions) as s:
        for w in ("w-1", "w-2"):
            workers_db.register(s, w, "h", CPU_1T)
    spec = {"base_model": "tiny", "dataset_id": dataset_id, "max_steps": 1}
    single = client.post("/jobs", json=spec).json()["id"]
    with session_scope(sessions) as s:  # w-1 runs a one-node job (claimed as its worker claims it)
        assert jobs_db.claim(s, job_id=single, worker_id="w-1", lease_seconds=60) == 1
        workers_db.set_current_job(s, "w-1", single)
    r = client.post("/jobs", json={**spec, "num_nodes": 2})
    assert r.status_code == 202, r.text
    gang = r.json()["id"]

    queue = queue_of(client, gang)
    reason = str(queue["waiting_reason"])
    assert reason.startswith("needs 2 workers with 1 device of >= ")
    assert reason.endswith(" GiB each, at once; 1 has room now, 1 is busy"), reason
    print(f"\nwaiting_reason: {reason}")
    assert queue["position"] == 1 and queue["estimated_start"] is None  # no run time known for w-1's job

    with session_scope(sessions) as s:  # w-2 leaves the fleet: one more worker must join
        workers_db.mark_stopped(s, "w-2")
    reason = str(queue_of(client, gang)["waiting_reason"])
    assert reason.endswith(
        "each, at once; 0 have room now, 1 is busy; 1 more must join the fleet (1 alive fit)"
    )

    with session_scope(sessions) as s:  # w-2 is back and w-1's job ends: both have room, nothing to wait for
        workers_db.register(s, "w-2", "h", CPU_1T)
        assert jobs_db.finish(s, job_id=single, attempt=1, dst=JobStatus.SUCCEEDED, message="done")
        workers_db.set_current_job(s, "w-1", None)
    queue = queue_of(client, gang)
    assert queue["waiting_reason"] is None and queue["position"] == 1
    assert queue["estimated_start"] is not None  # both of its workers are idle: it starts now
