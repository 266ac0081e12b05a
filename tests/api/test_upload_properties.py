"""Property test of the upload route (hypothesis): random bytes and random JSON lines, sent as a
multipart file or a raw ndjson body, are never a 5xx and always get a report: 201 with a valid one,
or 422 `invalid_dataset` whose report names each problem's line, stored so it can be read again."""

from __future__ import annotations

from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.test_data_properties import lines

bodies = st.one_of(st.binary(max_size=400), lines.map(b"\n".join))


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,  # the same examples every run: a failure is reproducible, not flaky
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
@given(body=bodies, raw=st.booleans())
def test_any_upload_gets_a_report_never_a_server_error(client: TestClient, body: bytes, raw: bool) -> None:
    if raw:
        r = client.post("/datasets", content=body, headers={"content-type": "application/x-ndjson"})
    else:
        r = client.post("/datasets", files={"file": ("x.jsonl", body)})
    assert r.status_code in (201, 422), r.text
    if r.status_code == 201:
        dataset = r.json()
        report = dataset["report"]
        assert dataset["status"] == "valid" and report["problems"] == []
    else:
        error = r.json()["error"]
        assert error["code"] == "invalid_dataset", error
        dataset, report = error["details"], error["details"]["report"]
        # Line 0 is the whole file (too_few_examples); every other problem names a line of the body.
        assert report["problems"] and all(0 <= p["line"] <= report["num_lines"] for p in report["problems"])
        assert all((p["line"] == 0) == (p["code"] == "too_few_examples") for p in report["problems"])
        assert sum(report["problem_counts"].values()) >= len(report["problems"])
    assert report["size_bytes"] == len(body)
    stored = client.get(f"/datasets/{dataset['id']}")
    assert stored.status_code == 200 and stored.json()["report"] == report
