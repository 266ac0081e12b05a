"""The official openai SDK's `client.files` against a real server: /v1/files over ftune's datasets."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.openai.conftest import ALPACA, Server, jsonl

Tenant = tuple[openai.OpenAI, httpx.Client]


def upload(sdk: openai.OpenAI, data: bytes = ALPACA, name: str = "train.jsonl") -> str:
    return sdk.files.create(file=(name, data), purpose="fine-tune").id


def test_upload_wait_retrieve_content(tenant: Tenant, tmp_path: Path) -> None:
    sdk, _ = tenant
    path = tmp_path / "alpaca.jsonl"
    path.write_bytes(ALPACA)
    before = int(time.time())
    with path.open("rb") as f:
        created = sdk.files.create(file=f, purpose="fine-tune")
    assert created.object == "file"
    assert created.filename == "alpaca.jsonl"
    assert created.bytes == len(ALPACA)
    assert created.purpose == "fine-tune"
    assert created.status == "processed"  # validated while it streamed in
    assert created.status_details is None
    assert before - 1 <= created.created_at <= int(time.time())

    done = sdk.files.wait_for_processing(created.id, poll_interval=0.1, max_wait_seconds=10)
    assert done == created
    assert sdk.files.retrieve(created.id) == created
    assert sdk.files.content(created.id).read() == ALPACA


def test_invalid_file_is_stored_with_status_error_and_line_numbers(tenant: Tenant) -> None:
    sdk, native = tenant
    bad = ALPACA + b"{not json\n" + json.dumps({"instruction": "no output"}).encode() + b"\n"
    created = sdk.files.create(file=("bad.jsonl", bad), purpose="fine-tune")
    assert created.status == "error"
    done = sdk.files.wait_for_processing(created.id, poll_interval=0.1, max_wait_seconds=10)
    assert done.status == "error"
    details = done.status_details or ""
    assert "2 problem(s)" in details
    assert "line 6" in details and "[invalid_json]" in details
    assert "line 7" in details and "[missing_field]" in details
    # The same dataset natively, with the validator's full report.
    ds = native.get(f"/datasets/{created.id}").json()
    assert ds["status"] == "invalid"
    assert [p["line"] for p in ds["report"]["problems"]] == [6, 7]


def test_list_auto_paginates_over_every_file(tenant: Tenant) -> None:
    sdk, _ = tenant
    ids = [upload(sdk, name=f"f{i}.jsonl") for i in range(5)]

    first = sdk.files.list(limit=2)
    assert [f.id for f in first.data] == ids[::-1][:2]  # newest first by default
    assert first.has_more is True
    assert sdk.files.list(limit=2, after=first.data[-1].id).data == first.get_next_page().data

    assert [f.id for f in sdk.files.list(limit=2)] == ids[::-1]  # the SDK walks every page
    assert [f.id for f in sdk.files.list(limit=2, order="asc")] == ids
    assert [f.id for f in sdk.files.list(limit=2, purpose="fine-tune")] == ids[::-1]
    assert list(sdk.files.list(purpose="batch")) == []

    raw = sdk.files.with_raw_response.list(limit=5).http_response.json()
    assert raw["object"] == "list" and raw["has_more"] is False
    assert (raw["first_id"], raw["last_id"]) == (ids[-1], ids[0])


def test_delete(tenant: Tenant, server: Server) -> None:
    sdk, native = tenant
    file_id = upload(sdk)
    stored = server.data_dir / "datasets" / f"{file_id}.jsonl"
    assert stored.exists()

    deleted = sdk.files.delete(file_id)
    assert (deleted.id, deleted.object, deleted.deleted) == (file_id, "file", True)
    assert not stored.exists()
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        sdk.files.delete(file_id)
    assert native.get(f"/datasets/{file_id}").status_code == 404
    assert file_id not in [f.id for f in sdk.files.list()]


def test_delete_is_refused_while_an_unfinished_job_uses_the_file(tenant: Tenant, server: Server) -> None:
    sdk, native = tenant
    file_id = upload(sdk)
    r = native.post("/jobs", json={"base_model": "tiny", "dataset_id": file_id, "max_steps": 1})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]  # no worker runs here: it stays queued

    with pytest.raises(openai.BadRequestError) as e:
        sdk.files.delete(file_id)
    assert e.value.status_code == 400  # not 409, which the SDK would retry
    assert (e.value.code, e.value.param, e.value.type) == ("file_in_use", "file_id", "invalid_request_error")
    assert job_id in e.value.message
    assert sdk.files.retrieve(file_id).status == "processed"

    # Once the job is finished the file can go; the job's record still names it.
    assert native.post(f"/jobs/{job_id}/cancel").status_code == 202
    assert native.get(f"/jobs/{job_id}").json()["status"] == "cancelled"
    assert sdk.files.delete(file_id).deleted is True
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(file_id)
    assert not (server.data_dir / "datasets" / f"{file_id}.jsonl").exists()
    assert native.get(f"/datasets/{file_id}").json()["status"] == "deleted"
    assert native.get(f"/jobs/{job_id}").json()["spec"]["dataset_id"] == file_id


def test_a_file_is_a_dataset_and_a_dataset_is_a_file(tenant: Tenant) -> None:
    sdk, native = tenant
    file_id = upload(sdk, name="via-v1.jsonl")
    ds = native.get(f"/datasets/{file_id}").json()
    assert (ds["filename"], ds["status"], ds["size_bytes"]) == ("via-v1.jsonl", "valid", len(ALPACA))

    r = native.post("/datasets", files={"file": ("native.jsonl", ALPACA)})
    assert r.status_code == 201, r.text
    f = sdk.files.retrieve(r.json()["id"])
    assert (f.filename, f.status, f.bytes) == ("native.jsonl", "processed", len(ALPACA))
    assert sdk.files.content(f.id).read() == ALPACA
    assert {x.id for x in sdk.files.list()} == {file_id, f.id}


def test_upload_over_the_json_body_limit_streams(tenant: Tenant) -> None:
    """Uploads are exempt from the 1 MiB cap on JSON bodies, as on POST /datasets."""
    sdk, _ = tenant
    rows = ({"instruction": f"Repeat {i}: " + "x" * 200, "output": str(i)} for i in range(8000))
    big = jsonl(*rows)
    assert len(big) > 1.5 * 2**20
    created = sdk.files.create(file=("big.jsonl", io.BytesIO(big)), purpose="fine-tune")
    assert (created.status, created.bytes) == ("processed", len(big))


def test_an_upload_retried_with_its_idempotency_key_gets_the_first_file(tenant: Tenant) -> None:
    """`extra_headers={"Idempotency-Key": ...}` makes a retried upload safe: the same key, file and purpose
    answer the first file (Idempotent-Replayed: true) and store nothing more; another file under that key
    is refused, and a refused upload (a bad purpose) releases its key."""
    sdk, _ = tenant
    key = {"Idempotency-Key": "upload-1"}
    first = sdk.files.with_raw_response.create(
        file=("t.jsonl", ALPACA), purpose="fine-tune", extra_headers=key
    )
    again = sdk.files.with_raw_response.create(
        file=("t.jsonl", ALPACA), purpose="fine-tune", extra_headers=key
    )
    assert again.headers.get("idempotent-replayed") == "true" and "idempotent-replayed" not in first.headers
    assert again.parse() == first.parse()
    assert [f.id for f in sdk.files.list()] == [first.parse().id]
    with pytest.raises(openai.BadRequestError) as e:
        sdk.files.create(file=("t.jsonl", ALPACA + ALPACA), purpose="fine-tune", extra_headers=key)
    assert e.value.code == "idempotency_key_reused"

    other = {"Idempotency-Key": "upload-2"}
    with pytest.raises(openai.BadRequestError) as e:
        sdk.files.create(file=("t.jsonl", ALPACA), purpose="batch", extra_headers=other)
    assert e.value.code == "invalid_purpose"
    assert (
        sdk.files.create(file=("t.jsonl", ALPACA), purpose="fine-tune", extra_headers=other).id
        != first.parse().id
    )
