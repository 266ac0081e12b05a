"""The one error shape: {"error": {"code", "message", "param", "details"}}, with the right status."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from core import errors

log = logging.getLogger(__name__)


def error_body(code: str, message: str, param: str | None = None, details: Any = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "param": param, "details": details}}


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or None


def _describe(err: dict[str, Any]) -> dict[str, Any]:
    param = _param(tuple(err.get("loc", ())))
    if err.get("type") == "extra_forbidden":
        message = f"unknown field {param!r}"
    else:
        message = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
    return {"param": param, "message": message, "type": err.get("type")}


def install(app: FastAPI) -> None:
    @app.exception_handler(errors.FtuneError)
    async def _domain(_: Request, exc: errors.FtuneError) -> JSONResponse:
        headers = {}
        if isinstance(exc, errors.RateLimited):
            headers["Retry-After"] = str(exc.retry_after)
        if isinstance(exc, errors.Unauthorized):
            headers["WWW-Authenticate"] = "Bearer"
        body = error_body(exc.code, exc.message, exc.param, exc.details)
        return JSONResponse(body, errors.status_for(exc), headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [_describe(e) for e in exc.errors()]
        first = problems[0] if problems else {"param": None, "message": "invalid request"}
        code = "invalid_json" if any(p["type"] == "json_invalid" for p in problems) else "invalid_request"
        message = str(first["message"]) + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
        return JSONResponse(error_body(code, message, first["param"], problems), 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = errors.HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        return JSONResponse(error_body(code, str(exc.detail)), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Never leak stack traces or paths; the log has them.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal_error", "internal server error"), 500)
