from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.upload import FileSink
from core.errors import PayloadTooLarge
from core.settings import Settings
from tests.api.conftest import ALPACA, jsonl


def test_multipart_upload_is_validated_and_stored(client: TestClient, settings: Settings) -> None:
    r = client.post("/datasets", files={"file": ("train.jsonl", ALPACA)})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["status"] == "valid" and body["format"] == "instruction" and body["num_examples"] == 5
    assert body["filename"] == "train.jsonl"
    stored = settings.data_dir / "datasets" / f"{body['id']}.jsonl"
    assert stored.read_bytes() == ALPACA
    assert client.get(f"/datasets/{body['id']}").json()["sha256"] == body["sha256"]


def test_raw_ndjson_upload(client: TestClient) -> None:
    r = client.post(
        "/datasets?filename=x.jsonl", content=ALPACA, headers={"content-type": "application/x-ndjson"}
    )
    assert r.status_code == 201, r.text
    assert r.json()["num_examples"] == 5


def test_not_jsonl_is_422_with_line_number(client: TestClient) -> None:
    body = jsonl({"instruction": "a", "output": "b"}) + b"this is not json\n"
    r = client.post("/datasets", files={"file": ("bad.jsonl", body)})
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["code"] == "invalid_dataset" and "line 2" in err["message"]
    problems = err["details"]["report"]["problems"]
    assert problems[0]["line"] == 2 and problems[0]["code"] == "invalid_json"
    # Stored as invalid so the report can be read again.
    assert client.get(f"/datasets/{err['details']['id']}").json()["status"] == "invalid"


def test_oversized_upload_is_413_and_leaves_nothing(client: TestClient, settings: Settings) -> None:
    big = jsonl(*({"text": "x" * 1000} for _ in range(100)))  # ~100 KB > 64 KiB limit
    r = client.post("/datasets", files={"file": ("big.jsonl", big)})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "payload_too_large"
    assert list((settings.data_dir / "datasets").iterdir()) == []
    assert list(Path(settings.data_dir / "tmp").iterdir()) == []


def test_multipart_without_file_field(client: TestClient) -> None:
    r = client.post("/datasets", files={"other": ("a.jsonl", ALPACA)})
    assert r.status_code == 422 and r.json()["error"]["code"] == "missing_file"


def test_unknown_dataset_is_404(client: TestClient) -> None:
    r = client.get("/datasets/0123456789abcdef")
    assert r.status_code == 404 and r.json()["error"]["code"] == "dataset_not_found"


def test_list_paginates(client: TestClient) -> None:
    ids = {client.post("/datasets", files={"file": ("a.jsonl", ALPACA)}).json()["id"] for _ in range(3)}
    first = client.get("/datasets?limit=2").json()
    assert len(first["data"]) == 2 and first["has_more"]
    second = client.get(f"/datasets?limit=2&after={first['next_cursor']}").json()
    assert not second["has_more"]
    assert {d["id"] for d in first["data"] + second["data"]} == ids


def test_file_sink_never_writes_past_the_limit(tmp_path: Path) -> None:
    fed: list[bytes] = []
    sink = FileSink(tmp_path / "f", fed.append, max_bytes=10)
    sink.write(b"12345678")
    with pytest.raises(PayloadTooLarge):
        sink.write(b"abc")  # would make 11 bytes: refused whole, before it reaches the disk
    sink.close()
    assert (tmp_path / "f").read_bytes() == b"12345678" and fed == [b"12345678"]


def _chunked(*parts: bytes) -> Iterator[bytes]:
    yield from parts  # a generator body is sent chunked, with no Content-Length to refuse up front


def test_many_form_fields_cannot_grow_memory(client: TestClient, settings: Settings) -> None:
    boundary = "b0undary"
    field = b"x" * 1000
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="f{i}"\r\n\r\n'.encode() + field + b"\r\n"
        for i in range(200)  # ~200 KB of fields, each well under any per-field limit
    ]
    r = client.post(
        "/datasets",
        content=_chunked(*parts, f"--{boundary}--\r\n".encode()),
        headers={"content-type": f"multipart/form-data; boundary={boundary}"},
    )
    assert r.status_code == 413 and r.json()["error"]["details"] == {"max_form_bytes": 64 * 1024}
    huge_header = f"--{boundary}\r\nX-Padding: ".encode() + b"y" * 100_000
    r = client.post(
        "/datasets",
        content=_chunked(huge_header, b"\r\n\r\n"),
        headers={"content-type": f"multipart/form-data; boundary={boundary}"},
    )
    assert r.status_code in (413, 422), r.text  # python-multipart bounds a part's header itself
    assert list((settings.data_dir / "tmp").iterdir()) == []
