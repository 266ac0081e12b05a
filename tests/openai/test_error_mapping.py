"""Every kind of ftune error, as /v1 answers it: the status the SDK maps to the right exception, and no
status the SDK retries for what a retry cannot fix."""

from __future__ import annotations

import json

import pytest
from starlette.requests import Request

from api.openai.errors import to_response
from core import errors

RETRIED = {408, 409, 429} | set(range(500, 600))  # openai's _should_retry


def answer(exc: Exception) -> tuple[int, dict[str, object], dict[str, str]]:
    request = Request({"type": "http", "method": "GET", "path": "/v1/files", "headers": []})
    response = to_response(request, exc)
    return response.status_code, json.loads(response.body)["error"], dict(response.headers)


@pytest.mark.parametrize(
    ("exc", "status", "type_"),
    [
        (errors.InvalidInput("bad", param="purpose"), 400, "invalid_request_error"),
        (errors.Infeasible("does not fit"), 400, "invalid_request_error"),
        (errors.Unsupported("no dpo"), 400, "invalid_request_error"),
        (errors.Conflict("job finished", code="job_finished"), 400, "invalid_request_error"),
        (errors.NotFound("no such file", code="file_not_found"), 404, "invalid_request_error"),
        (errors.Unauthorized("bad key"), 401, "authentication_error"),
        (errors.Forbidden("admins only"), 403, "permission_error"),
        (errors.PayloadTooLarge("too big"), 413, "invalid_request_error"),
        (errors.Conflict("in flight", code="idempotency_key_in_flight"), 409, "invalid_request_error"),
        (errors.RequestTimeout("stalled"), 408, "invalid_request_error"),
        (errors.RateLimited("slow down", retry_after=7), 429, "rate_limit_error"),
        (errors.Unavailable("database down"), 503, "server_error"),
    ],
)
def test_domain_errors(exc: errors.FtuneError, status: int, type_: str) -> None:
    got, body, headers = answer(exc)
    assert got == status
    assert body == {"message": exc.message, "type": type_, "param": exc.param, "code": exc.code}
    if isinstance(exc, errors.RateLimited):
        assert headers["retry-after"] == "7"
    transient = status in (408, 429, 503) or exc.code == "idempotency_key_in_flight"
    assert (status in RETRIED) == transient


def test_a_bug_is_a_bare_500(caplog: pytest.LogCaptureFixture) -> None:
    status, body, _ = answer(RuntimeError("secret /etc/path"))
    assert status == 500
    assert body == {
        "message": "internal server error",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
    assert "secret /etc/path" in caplog.text  # the log has the cause
