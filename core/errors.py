"""The error catalogue. A domain error carries a stable machine-readable code and has an HTTP status per
surface (STATUS, status_for); a status has one OpenAI error type (openai_type) and one code for an HTTP
error raised without one (HTTP_CODES). The native API (api/errors.py), /v1 (api/openai/errors.py) and the
inference engine (inference/errors.py) all answer from these tables."""

from __future__ import annotations

import re
from typing import Any, Literal, NamedTuple


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


class Status(NamedTuple):
    """An error's HTTP status on each surface that answers it."""

    native: int  # /jobs, /datasets, ... (api/errors.py)
    # /v1 (api/openai/errors.py): the statuses the openai SDK maps to its exception classes. It retries 408,
    # 409, 429 and >= 500, so what a retry cannot fix is a 400 (a conflict too, but TRANSIENT_CONFLICTS).
    openai: int
    # The inference engine (inference/server.py): a domain error there is a request it cannot serve; its
    # own refusals (404 model_not_found, 429, 504) are inference.errors.EngineError.
    engine: int


Surface = Literal["native", "openai", "engine"]
OpenAIType = Literal[
    "invalid_request_error", "authentication_error", "permission_error", "rate_limit_error", "server_error"
]
# OpenAI's error types by status, as its API answers them (a 404 model_not_found is invalid_request_error)
OPENAI_TYPES: dict[int, OpenAIType] = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
}
# The code of an HTTP error raised without a domain error (routing, a body too large for the server)
HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}

STATUS: dict[type[FtuneError], Status] = {
    FtuneError: Status(400, 400, 400),
    NotFound: Status(404, 404, 400),
    InvalidInput: Status(422, 400, 400),
    Conflict: Status(409, 400, 400),
    Infeasible: Status(422, 400, 400),
    Unsupported: Status(422, 400, 400),
    PayloadTooLarge: Status(413, 413, 400),
    Unavailable: Status(503, 503, 400),
    Unauthorized: Status(401, 401, 400),
    Forbidden: Status(403, 403, 400),
    RateLimited: Status(429, 429, 400),
    RequestTimeout: Status(408, 408, 400),
}
# Conflicts that go away by waiting: on /v1 they stay 409, the one conflict the SDK's retry is right for.
TRANSIENT_CONFLICTS = frozenset({"idempotency_key_in_flight"})


def status_for(exc: FtuneError, surface: Surface = "native") -> int:
    """The HTTP status that answers `exc` on `surface` (a subclass: its nearest listed class's)."""
    if surface == "openai" and isinstance(exc, Conflict) and exc.code in TRANSIENT_CONFLICTS:
        return 409
    row = next(STATUS[cls] for cls in type(exc).__mro__ if cls in STATUS)
    return int(getattr(row, surface))


def openai_type(status: int) -> OpenAIType:
    """OpenAI's error type for a status (server_error from 500 on, else invalid_request_error)."""
    return OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


# An absolute POSIX path of two components or more, not part of a URL or a relative path.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])/(?:[^\s/'\"`,;:()\[\]{}<>]+/)+([^\s/'\"`,;:()\[\]{}<>]*)")


def without_paths(message: str) -> str:
    """`message` as a tenant may see it: each absolute path (the data directory's, a model's, a library's in
    a traceback) cut to its last component, ".../adapter_config.json". The server's log keeps the whole."""
    return _ABSOLUTE_PATH.sub(lambda m: f".../{m.group(1)}", message)
