"""Errors: one shape for every 4xx/5xx, and a 500 never leaks a stack trace, a path or the cause."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.deps import get_session

GENERIC_500 = {
    "error": {"code": "internal_error", "message": "internal server error", "param": None, "details": None}
}
SECRET = "/srv/ftune/secret/ftune.db"


def _is_error_shape(body: object) -> bool:
    return (
        isinstance(body, dict)
        and set(body) == {"error"}
        and set(body["error"]) == {"code", "message", "param", "details"}
        and isinstance(body["error"]["code"], str)
        and isinstance(body["error"]["message"], str)
    )


def _broken_session() -> None:
    # A double for the database session: fails like a driver would, with a path in its message.
    raise OSError(f"unable to open database file {SECRET}")


def test_unexpected_error_is_a_generic_500(
    app: FastAPI, client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    app.dependency_overrides[get_session] = _broken_session
    with (
        TestClient(app, headers=dict(client.headers), raise_server_exceptions=False) as c,
        caplog.at_level(logging.ERROR, logger="api.errors"),
    ):
        for path in ("/jobs", "/datasets", "/jobs/0123456789abcdef", "/datasets/0123456789abcdef"):
            r = c.get(path)
            assert r.status_code == 500, path
            assert r.json() == GENERIC_500
            assert r.headers["content-type"] == "application/json"
            for leak in (SECRET, "Traceback", "OSError", "File ", ".py"):
                assert leak not in r.text
    # The operator still gets the cause, in the log.
    assert SECRET in caplog.text and "Traceback" in caplog.text


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("get", "/no/such/route", 404, "not_found"),
        ("delete", "/jobs", 405, "method_not_allowed"),
        ("put", "/datasets/0123456789abcdef", 405, "method_not_allowed"),
        ("get", "/jobs?limit=0", 422, "invalid_request"),
        ("get", "/jobs?after=%%%", 422, "invalid_cursor"),
        ("get", "/jobs?status=bogus", 422, "invalid_request"),
        ("get", "/workers", 403, "forbidden"),
    ],
)
def test_framework_errors_use_the_one_shape(
    client: TestClient, method: str, path: str, status: int, code: str
) -> None:
    r = client.request(method, path)
    assert r.status_code == status, r.text
    assert _is_error_shape(r.json()) and r.json()["error"]["code"] == code


def test_undecodable_json_body_is_400_in_the_shape(client: TestClient) -> None:
    r = client.post(
        "/jobs", content=b'{"base_model": "\xff\xfe"}', headers={"content-type": "application/json"}
    )
    assert r.status_code in (400, 422) and _is_error_shape(r.json())


def test_json_bodies_are_capped(client: TestClient, dataset_id: str) -> None:
    spec = {"base_model": "tiny", "dataset_id": dataset_id}
    padded = json.dumps(spec | {"pad": "x" * (2 << 20)}).encode()  # 2 MiB, would be buffered whole
    for url in ("/jobs", "/plan"):
        r = client.post(url, content=padded, headers={"content-type": "application/json"})
        assert r.status_code == 413 and _is_error_shape(r.json()), r.text

        def chunks(body: bytes = padded) -> Iterator[bytes]:  # no Content-Length: cut off on the way
            for i in range(0, len(body), 64 * 1024):
                yield body[i : i + 64 * 1024]

        r = client.post(url, content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large", r.text
    assert client.post("/jobs", json=spec).status_code == 202  # an ordinary body is untouched
