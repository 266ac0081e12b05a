"""The engine's one error type, rendered as OpenAI's error object by the server."""

from __future__ import annotations

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    504: "timeout_error",
}


class EngineError(Exception):
    """A request the engine refuses or cannot finish: HTTP status, stable code, message, offending param."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


class Busy(Exception):
    """Not now: what a request needs is held by requests decoding (it waits in line, no error)."""


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> EngineError:
    return EngineError(400, code, message, param=param)


def model_not_found(name: str) -> EngineError:
    return EngineError(
        404,
        "model_not_found",
        f"The model {name!r} does not exist: neither a base model of this engine nor a loaded LoRA adapter.",
        param="model",
    )
