"""GET /jobs/{id}/samples (the owner only), the sample fields' 422s, and the samples event on /v1."""

from __future__ import annotations

import json

from fastapi import FastAPI
from fastapi.testclient import TestClient

from core.run_protocol import SampleItem, SamplesRecord
from core.storage import atomic_write_text
from models import jobs as jobs_db
from models.db import session_scope
from worker.progress import samples_document, samples_message

CHAT = [{"role": "user", "content": "Add 2 and 1."}]


def store(app: FastAPI, job_id: str, *records: SamplesRecord) -> None:
    """What the worker does with samples records: the file, and an event per set."""
    services = app.state.services
    doc = samples_document(list(records))
    atomic_write_text(services.storage.samples_path(job_id), json.dumps(doc))
    with session_scope(services.sessions) as s:
        for rec in records:
            data = rec.model_dump(mode="json", exclude={"type"})
            jobs_db.add_event(s, job_id=job_id, kind="samples", message=samples_message(rec), data=data)


def test_samples_of_ones_own_job_and_404_for_another_tenant(
    app: FastAPI, client: TestClient, other_client: TestClient, dataset_id: str
) -> None:
    spec = {"base_model": "tiny", "dataset_id": dataset_id, "sample_prompts": ["Add 1 and 1.", CHAT]}
    job = client.post("/jobs", json=spec).json()
    assert job["spec"]["sample_prompts"] == ["Add 1 and 1.", CHAT]
    assert client.get(f"/jobs/{job['id']}/samples").json() == {
        "job_id": job["id"],
        "latest": None,
        "sets": [],
    }

    items = [
        SampleItem(prompt="Add 1 and 1.", base="1 1 1", tuned="2"),
        SampleItem(prompt=CHAT, base="", tuned="3"),
    ]
    store(
        app,
        job["id"],
        SamplesRecord(step=2, at="eval", items=items[:1]),
        SamplesRecord(step=4, at="end", items=items),
    )
    body = client.get(f"/jobs/{job['id']}/samples").json()
    assert [(s["step"], s["at"], len(s["items"])) for s in body["sets"]] == [(2, "eval", 1), (4, "end", 2)]
    assert body["latest"] == body["sets"][-1]
    assert body["latest"]["items"][1] == {"prompt": CHAT, "base": "", "tuned": "3"}

    r = other_client.get(f"/jobs/{job['id']}/samples")
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"
    assert client.get("/jobs/0123456789abcdef/samples").status_code == 404

    # The /v1 events list the samples events with a readable message.
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"limit": 100}).json()["data"]
    messages = [e["message"] for e in events if e["message"].startswith("samples")]
    assert messages == [
        "samples at step 4 (at the end): 2 prompts; first: 'Add 1 and 1.' -> base '1 1 1', tuned '2'",
        "samples at step 2 (at evaluation): 1 prompt; first: 'Add 1 and 1.' -> base '1 1 1', tuned '2'",
    ]


def test_bad_sample_fields_are_422_naming_the_field(client: TestClient, dataset_id: str) -> None:
    for value, words in (
        (40, "0-32"),
        ([[{"role": "assistant", "content": "hi"}]], "must end with a user message"),
        ([""], "prompt 0 is empty"),
    ):
        r = client.post(
            "/jobs", json={"base_model": "tiny", "dataset_id": dataset_id, "sample_prompts": value}
        )
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["param"] == "sample_prompts" and words in err["message"], err
    r = client.post("/jobs", json={"base_model": "tiny", "dataset_id": dataset_id, "sample_max_tokens": 9999})
    assert r.status_code == 422 and r.json()["error"]["param"] == "sample_max_tokens"


def test_v1_takes_the_sample_fields_as_extra_body_fields(client: TestClient, dataset_id: str) -> None:
    body = {"model": "tiny", "training_file": dataset_id, "sample_prompts": 3, "sample_max_tokens": 16}
    r = client.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 200, r.text
    spec = client.get(f"/jobs/{r.json()['id']}").json()["spec"]
    assert (spec["sample_prompts"], spec["sample_max_tokens"]) == (3, 16)
    r = client.post("/v1/fine_tuning/jobs", json={**body, "sample_prompts": [["not a message"]]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "sample_prompts" and "message 0" in r.json()["error"]["message"]
