"""Property-based fuzz of the whole API from its own OpenAPI document (schemathesis).

Every documented operation gets generated requests, valid and invalid, sent with an admin key to the
real app on a real migrated SQLite database. Each answer must be no 5xx, a documented status, the
documented content type, and a body that matches the documented schema (errors included).
The number of examples is bounded so that `make test` stays fast; raise FTUNE_FUZZ_EXAMPLES locally.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.schemas import APIOperation
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.deps import get_session
from api.main import create_app
from core.settings import Settings
from models.migrate import upgrade
from tests.api.conftest import ALPACA, TINY_CONFIG, RecordingEnqueuer, RecordingTokenStats

ADMIN_KEY = "ftk_fuzzadmin000_" + "f" * 32
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = int(os.environ.get("FTUNE_FUZZ_EXAMPLES", "30"))


@pytest.fixture
def fuzz_app(tmp_path: Path, sqlite_url: str) -> Iterator[FastAPI]:
    upgrade(sqlite_url)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    # Small enough that a generated spec can fit plan_gpu, so admission and planning run to the end.
    config = TINY_CONFIG | {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    config |= {"num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000}
    (tmp_path / "models" / "tiny" / "config.json").write_text(json.dumps(config))
    settings = Settings(
        data_dir=tmp_path / "data",
        models_dir=tmp_path / "models",
        database_url=sqlite_url,
        hf_cache_dir=tmp_path / "hf",
        max_upload_bytes=64 * 1024,
        bootstrap_admin_key=ADMIN_KEY,
        rate_limit_per_minute=1_000_000,  # the fuzz is one fast client; 429s would hide the rest
        upload_idle_timeout_seconds=5,
        plan_gpu="24GB",  # a configured deployment: /plan without a fleet would be a (documented) 503
        hub_pull_enabled=False,  # POST /models/pull answers its documented 403: no download from the Hub
    )
    # Ready statistics (of the shape training.token_stats prints), so job bodies carry numbers too.
    stats = {"status": "ready", "source": "job_created", "count": 5, "p50": 20, "p95": 24, "max": 24}
    stats |= {"max_seq_len": 512, "over_max_seq_len": 0, "over_length": "truncate", "dropped": 0}
    stats |= {
        "packing": True,
        "micro_batches_per_epoch": 1,
        "steps_per_epoch": 1,
        "examples_per_micro_batch": 5,
    }
    token_stats = RecordingTokenStats(stats)
    app = create_app(settings, enqueue=RecordingEnqueuer(), token_stats=token_stats)
    token_stats.bind(app)
    app.state.services.broker_ping = lambda: True  # /ready: the broker is not what is fuzzed here
    yield app
    app.state.services.engine.dispose()


def _with_real_ids(case: schemathesis.Case, ids: dict[str, str]) -> schemathesis.Case:
    """Point a generated request at rows that exist, so the fuzz gets past the 404s and 422s too."""
    for name, value in ids.items():
        if case.path_parameters and name in case.path_parameters:
            case.path_parameters[name] = value
    if isinstance(case.body, dict):
        if "dataset_id" in case.body:
            case.body["dataset_id"] = ids["dataset_id"]
        if "base_model" in case.body:
            case.body["base_model"] = "tiny"
        if "file" in case.body:
            case.body["file"] = ALPACA
    return case


def _fuzz(operation: APIOperation, ids: dict[str, str]) -> None:
    """Valid and invalid requests for one operation; raises on the first failing check."""
    generated = st.one_of(*(operation.as_strategy(mode) for mode in GenerationMode))
    strategy = st.one_of(generated, generated.map(lambda case: _with_real_ids(case, ids)))

    @given(case=strategy)
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,  # the same examples every run: a failure here is reproducible, not flaky
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def run(case: schemathesis.Case) -> None:
        case.call_and_validate(headers=AUTH, checks=CHECKS)

    run()


def test_api_fuzz(fuzz_app: FastAPI) -> None:
    # A real dataset and job, so that reading, listing and cancelling meet real rows too.
    with TestClient(fuzz_app, headers=AUTH) as c:
        r = c.post("/datasets", files={"file": ("a.jsonl", ALPACA)})
        assert r.status_code == 201, r.text
        ids = {"dataset_id": r.json()["id"]}
        r = c.post("/jobs", json={"base_model": "tiny", "dataset_id": ids["dataset_id"]})
        assert r.status_code == 202, r.text
        ids["job_id"] = r.json()["id"]
    # schemathesis' pytest integration (from_fixture) breaks on pytest 9.2, so operations are driven
    # directly: each one gets its own Hypothesis run, and every failing operation is reported.
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    failures: dict[str, str] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:
        try:
            _fuzz(operation, ids)
        except (Exception, FailureGroup) as e:  # a FailureGroup is a BaseExceptionGroup
            failures[operation.label] = str(e) + "".join(f"\n{f}" for f in getattr(e, "exceptions", ()))
    assert not failures, "\n\n".join(f"{label}\n{err}" for label, err in failures.items())


def test_the_fuzz_catches_a_server_error(fuzz_app: FastAPI) -> None:
    def broken() -> None:
        raise RuntimeError("a bug")

    fuzz_app.dependency_overrides[get_session] = broken
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    operation = schema["/jobs"]["GET"]
    with pytest.raises((Exception, FailureGroup)):
        _fuzz(operation, {})
