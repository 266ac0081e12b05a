"""Domain errors. Each carries a stable machine-readable code; the API maps classes to HTTP statuses."""

from __future__ import annotations

from typing import Any


class FtuneError(Exception):
    code = "error"

    def __init__(
        self, message: str, *, code: str | None = None, param: str | None = None, details: Any = None
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param
        self.details = details


class NotFound(FtuneError):
    code = "not_found"


class InvalidInput(FtuneError):
    code = "invalid_input"


class Unauthorized(FtuneError):
    code = "unauthorized"


class Forbidden(FtuneError):
    code = "forbidden"


class RateLimited(FtuneError):
    """Too many requests or too many active jobs; retry after `retry_after` seconds."""

    code = "rate_limited"

    def __init__(self, message: str, *, retry_after: int, code: str | None = None) -> None:
        super().__init__(message, code=code, details={"retry_after_seconds": retry_after})
        self.retry_after = retry_after


class Conflict(FtuneError):
    code = "conflict"


class Infeasible(FtuneError):
    """The planner says the job cannot fit on any GPU it may run on."""

    code = "infeasible"


class Unsupported(FtuneError):
    """A valid request for something this deployment cannot run."""

    code = "unsupported"


class PayloadTooLarge(FtuneError):
    code = "payload_too_large"


class RequestTimeout(FtuneError):
    code = "request_timeout"


class Unavailable(FtuneError):
    """A dependency (database, broker) is not reachable."""

    code = "unavailable"
