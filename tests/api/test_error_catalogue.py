"""One error catalogue (core.errors), rendered alike by every surface: for each status the engine's error
object and /v1's carry the same OpenAI type, the one OpenAI's API answers (a 404 model_not_found is an
invalid_request_error there); a domain error's status on each surface comes from the one STATUS table."""

from __future__ import annotations

import json

import pytest

from api.openai.errors import error_response
from core import errors
from inference.errors import EngineError

STATUSES = (400, 401, 403, 404, 408, 409, 413, 422, 429, 500, 503, 504)


@pytest.mark.parametrize("status", STATUSES)
def test_the_engine_and_v1_give_a_status_the_same_openai_type(status: int) -> None:
    engine = EngineError(status, "some_code", "message").body()["error"]["type"]
    v1 = json.loads(bytes(error_response(status, "message", "some_code").body))["error"]["type"]
    assert engine == v1 == errors.openai_type(status)


def test_openais_own_types() -> None:
    assert errors.openai_type(404) == "invalid_request_error"  # OpenAI's model_not_found
    assert errors.openai_type(401) == "authentication_error"
    assert errors.openai_type(429) == "rate_limit_error"
    assert errors.openai_type(503) == "server_error"


def test_every_domain_error_class_has_its_row() -> None:
    """A new error class gets its statuses in STATUS, not a guess at each surface."""
    defined = {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.FtuneError)}
    assert defined == set(errors.STATUS)
