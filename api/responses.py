"""The error responses in the OpenAPI document: every 4xx/5xx is the one shape from api.errors.

Routers declare the statuses they can answer with `errors(...)`, so clients (and the schema fuzz in
tests/api/test_fuzz.py) see exactly what comes back. FastAPI's own 422 schema ({"detail": [...]}) is
replaced, because the validation handler answers in the same shape as every other error.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str = Field(description="Stable, machine-readable, e.g. 'job_not_found'.")
    message: str = Field(description="For people; never a stack trace or a file path.")
    param: str | None = Field(description="The field, query parameter or header at fault, if any.")
    details: Any = Field(description="Code-specific, e.g. the list of validation problems.")


class ErrorResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


DESCRIPTIONS = {
    400: "The body could not be decoded (e.g. not UTF-8)",
    401: "Missing, invalid or revoked API key",
    403: "Needs an admin key",
    404: "Not found, or owned by another tenant",
    408: "The upload stalled",
    409: "Conflicts with the resource's state",
    413: "Over the size limit (upload, storage quota, or 1 MiB for a JSON body)",
    415: "Unsupported content type",
    422: "Invalid input; every problem is listed in details",
    429: "Rate or active-job limit; see Retry-After",
    500: "Internal error (generic; the log has the cause)",
    503: "A dependency is unavailable",
}
HEADERS = {
    401: {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer"}},
    429: {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait"}},
}

# What any authenticated route can answer, whatever it does.
AUTHED = (401, 422, 429, 500)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` entries for these error statuses, all with the one error shape."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": ErrorResponse, "description": DESCRIPTIONS[status]}
        if status in HEADERS:
            entry["headers"] = HEADERS[status]
        out[status] = entry
    return out
