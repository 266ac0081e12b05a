"""The engine's one error type, rendered as OpenAI's error object by the server (its type from the status,
core.errors.openai_type, as /v1 renders it)."""

from __future__ import annotations

from core.errors import openai_type


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
                "type": openai_type(self.status),
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
