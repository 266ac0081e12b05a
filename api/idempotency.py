"""Idempotency-Key handling for POST /jobs and POST /datasets.

The same key with the same body returns the first response (header Idempotent-Replayed: true);
the same key with a different body is a 422; a key whose first request is still running is a 409.
A request that fails creates nothing, so its key is released for a retry. A claim taken over (stale)
is fenced: its first owner's finish or release changes nothing (models.idempotency).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Header
from fastapi.responses import JSONResponse

from api.deps import Services
from core.errors import InvalidInput
from models import idempotency as idem

IdempotencyKeyHeader = Annotated[
    str | None,
    Header(alias="Idempotency-Key", max_length=255, description="Makes a retried POST safe to repeat."),
]


def body_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def replayed(status: int, body: Any) -> JSONResponse:
    return JSONResponse(body, status, headers={"Idempotent-Replayed": "true"})


def run_once(
    services: Services, scope: str, key: str | None, request_hash: str, handle: Callable[[], JSONResponse]
) -> JSONResponse:
    """Run `handle` at most once per (scope, key); replay its response for a retry."""
    if key is None:
        return handle()
    claimed = idem.claim(services.sessions, scope, key, request_hash)
    if not isinstance(claimed, idem.Owner):
        return replayed(*claimed)
    try:
        response = handle()
    except BaseException:
        idem.release(services.sessions, claimed)
        raise
    if response.status_code >= 400:
        idem.release(services.sessions, claimed)
    else:
        body = json.loads(bytes(response.body))
        idem.finish(services.sessions, claimed, request_hash, response.status_code, body)
    return response


def check_replay_body(services: Services, scope: str, key: str, request_hash: str) -> None:
    """For uploads, whose hash is known only after the body is read: refuse a different body."""
    row = idem.stored(services.sessions, scope, key)
    if row is not None and row.request_hash not in (None, request_hash):
        raise InvalidInput(
            "this Idempotency-Key was used with a different upload",
            code="idempotency_key_reused",
            param="Idempotency-Key",
        )
