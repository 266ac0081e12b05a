"""Errors under /v1 in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

The native API keeps its own shape (api/errors.py, installed on the app). Routes under /v1 use
`OpenAIRoute`, whose handler turns every error raised while serving them (domain errors, request
validation, HTTP errors, and bugs) into this shape before the app's handlers see it. A route class
rather than a mounted sub-application: /v1 shares the app's services, middleware, metrics labels and
OpenAPI document, and api/errors.py stays as it is.

Statuses are the ones the openai SDK maps to its exception classes (core.errors.STATUS, its `openai`
column): it retries 408, 409, 429 and >= 500, so a conflict that a retry cannot fix (a file in use, a
finished job) is a 400; only a conflict that resolves by itself (an Idempotency-Key still in flight)
keeps 409.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.jsonbody import ThreadDecodedRoute
from core import errors

log = logging.getLogger(__name__)


class OpenAIErrorDetail(BaseModel):
    message: str
    type: errors.OpenAIType
    param: str | None
    code: str | None


class OpenAIErrorResponse(BaseModel):
    error: OpenAIErrorDetail


def error_response(
    status: int,
    message: str,
    code: str | None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
    details: Any = None,
) -> JSONResponse:
    detail = OpenAIErrorDetail(message=message, type=errors.openai_type(status), param=param, code=code)
    body: dict[str, Any] = detail.model_dump()
    if details is not None:  # beyond OpenAI's four: an infeasible job's plan, as e.body["details"]
        body["details"] = details
    return JSONResponse({"error": body}, status, headers=headers)


def _domain(exc: errors.FtuneError) -> JSONResponse:
    headers = {}
    if isinstance(exc, errors.RateLimited):
        headers["Retry-After"] = str(exc.retry_after)
    if isinstance(exc, errors.Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    details = exc.details if isinstance(exc, errors.Infeasible) else None
    status = errors.status_for(exc, "openai")
    return error_response(status, exc.message, exc.code, exc.param, headers, details)


def _param(loc: tuple[Any, ...]) -> str | None:
    return ".".join(str(p) for p in loc if p not in ("body", "query", "path", "header")) or None


def _validation(exc: RequestValidationError) -> JSONResponse:
    problems = exc.errors()
    first = problems[0] if problems else {}
    param = _param(tuple(first.get("loc", ())))
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg", "invalid request"))
    if len(problems) > 1:
        message += f" (and {len(problems) - 1} more)"
    return error_response(400, message, "invalid_request", param)


def _http(exc: StarletteHTTPException) -> JSONResponse:
    code = errors.HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
    return error_response(exc.status_code, str(exc.detail), code, headers=exc.headers)


def to_response(request: Request, exc: Exception) -> JSONResponse:
    """The OpenAI-shaped answer to an error raised while serving a /v1 request."""
    if isinstance(exc, errors.FtuneError):
        return _domain(exc)
    if isinstance(exc, RequestValidationError):
        return _validation(exc)
    if isinstance(exc, StarletteHTTPException):
        return _http(exc)
    # Never leak stack traces or paths; the log has them.
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal server error", "internal_error")


class OpenAIRoute(ThreadDecodedRoute):
    """A route whose errors are answered in OpenAI's shape (see the module docstring); large JSON bodies
    are decoded off the event loop (api.jsonbody)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def openai_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                return to_response(request, exc)

        return openai_handler


DESCRIPTIONS = {
    400: "Invalid request, or a conflict a retry cannot fix (e.g. file_in_use)",
    401: "Missing, invalid or revoked API key (openai.AuthenticationError)",
    403: "Not allowed for this key",
    404: "Not found, or owned by another organization (openai.NotFoundError)",
    408: "The upload stalled",
    413: "Over the upload size limit or the storage quota",
    429: "Rate limit; see Retry-After",
    500: "Internal error (generic; the log has the cause)",
}
HEADERS = {
    401: {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer"}},
    429: {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait"}},
}
AUTHED = (400, 401, 429, 500)


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` entries of these statuses, in OpenAI's error shape."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {"model": OpenAIErrorResponse, "description": DESCRIPTIONS[status]}
        if status in HEADERS:
            out[status]["headers"] = HEADERS[status]
    return out
