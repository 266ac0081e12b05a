"""API tests in-process (TestClient) against a real migrated database; the broker is a recorded double.
(Token statistics computed by a real worker on a real broker: tests/api/test_token_stats.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.main import create_app
from core.settings import Settings
from models import jobs as jobs_db
from models.db import session_scope
from models.tenants import create_key

TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


class RecordingEnqueuer:
    def __init__(self) -> None:
        self.sent: list[str] = []

    def __call__(self, job_id: str) -> bool:
        self.sent.append(job_id)
        return True


class RecordingTokenStats:
    """The token statistics request as a double: records each job id and, given `result` and bound to
    the app's sessions, stores it as the worker would (else the job's token_stats stay "pending")."""

    def __init__(self, result: dict[str, Any] | None = None) -> None:
        self.result = result
        self.sent: list[str] = []
        self.sessions: Any = None

    def bind(self, app: FastAPI) -> None:
        self.sessions = app.state.services.sessions

    def __call__(self, job_id: str) -> bool:
        self.sent.append(job_id)
        if self.result is not None and self.sessions is not None:
            with session_scope(self.sessions) as s:
                jobs_db.store_token_stats(s, job_id, self.result)
        return True


@pytest.fixture
def settings(tmp_path: Path, migrated_url: str) -> Settings:
    models = tmp_path / "models"
    (models / "tiny").mkdir(parents=True)
    (models / "tiny" / "config.json").write_text(json.dumps(TINY_CONFIG))
    return Settings(
        data_dir=tmp_path / "data",
        models_dir=models,
        database_url=migrated_url,
        hf_cache_dir=tmp_path / "hf",
        max_upload_bytes=64 * 1024,
    )


@pytest.fixture
def enqueued() -> RecordingEnqueuer:
    return RecordingEnqueuer()


@pytest.fixture
def token_stats() -> RecordingTokenStats:
    return RecordingTokenStats()


@pytest.fixture
def app(
    settings: Settings, enqueued: RecordingEnqueuer, token_stats: RecordingTokenStats
) -> Iterator[FastAPI]:
    app = create_app(settings, enqueue=enqueued, token_stats=token_stats)
    token_stats.bind(app)
    yield app
    app.state.services.engine.dispose()


def new_key(app: FastAPI, tenant: str, admin: bool = False) -> dict[str, str]:
    with session_scope(app.state.services.sessions) as s:
        return {"Authorization": f"Bearer {create_key(s, tenant, is_admin=admin)}"}


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    """Tenant "acme", a normal (non-admin) key."""
    with TestClient(app, headers=new_key(app, "acme")) as c:
        yield c


@pytest.fixture
def other_client(app: FastAPI) -> Iterator[TestClient]:
    """A second tenant."""
    with TestClient(app, headers=new_key(app, "globex")) as c:
        yield c


@pytest.fixture
def admin_client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, headers=new_key(app, "ops", admin=True)) as c:
        yield c


def jsonl(*rows: object) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


ALPACA = jsonl(*({"instruction": f"Add {i} and 1.", "output": str(i + 1)} for i in range(5)))


@pytest.fixture
def dataset_id(client: TestClient) -> str:
    r = client.post("/datasets", files={"file": ("a.jsonl", ALPACA)})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])
