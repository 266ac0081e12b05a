"""A new job's token statistics: POST /jobs publishes `ftune.token_stats` on a real broker, a real CPU
worker (`ftune worker --queue cpu`) runs `python -m training.token_stats` against a locally built tiny
model and stores them on the job; GET /jobs/{id} and its events show them seconds later."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from core.settings import Settings
from models import workers as workers_db
from tests.api.conftest import jsonl, new_key
from tests.e2e.stack import Proc, env_for

REPO = Path(__file__).resolve().parents[2]
ALPACA = [json.loads(line) for line in (REPO / "examples" / "alpaca_small.jsonl").read_text().splitlines()]
MAPPING = {"question": "prompt", "answer": "completion"}


@pytest.fixture(scope="module")
def built_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from training.demo import TINY, build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("api-models"), name="demo", size=TINY)


Start = Callable[..., TestClient]


@pytest.fixture
def stack(settings: Settings, built_model: Path, embedded_broker: str, tmp_path: Path) -> Iterator[Start]:
    """start(**settings) -> a client of the app (model "demo" and "tiny") publishing to a real broker,
    with a real CPU worker on the same database, data directory and broker."""
    (settings.models_dir / "demo").symlink_to(built_model)
    opened: list[tuple[TestClient, Proc]] = []

    def start(**overrides: Any) -> TestClient:
        config = settings.model_copy(update={"redis_url": embedded_broker, **overrides})
        extra = {f"FTUNE_{k.upper()}": str(v) for k, v in overrides.items()}
        env = env_for(
            tmp_path,
            settings.models_dir,
            FTUNE_DATABASE_URL=config.database_url,
            FTUNE_REDIS_URL=embedded_broker,
        )
        worker = Proc(["worker", "--queue", "cpu"], {**env, **extra}, tmp_path / "cpu-worker.log")
        app = create_app(config)
        client = TestClient(app, headers=new_key(app, "acme"))
        client.__enter__()
        opened.append((client, worker))
        return client

    yield start
    for client, worker in opened:
        client.__exit__(None, None, None)
        code = worker.stop()
        assert code == 0, worker.tail()


@pytest.fixture
def real_client(stack: Start) -> TestClient:
    return stack()


def _upload(client: TestClient, rows: list[dict[str, Any]], mapping: dict[str, str] | None = None) -> str:
    form = {"column_mapping": json.dumps(mapping)} if mapping else {}
    r = client.post("/datasets", files={"file": ("d.jsonl", jsonl(*rows))}, data=form)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _settled(client: TestClient, job_id: str, timeout: float = 300) -> dict[str, Any]:
    # generous: the computation runs at nice 10, a few percent of a core beside the rest of the suite
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = client.get(f"/jobs/{job_id}").json()["token_stats"]
        if stats["status"] != "pending":
            return dict(stats)
        time.sleep(0.2)
    raise AssertionError("token statistics still pending")


def test_stats_are_ready_soon_after_the_job_is_created(real_client: TestClient, built_model: Path) -> None:
    from training import data
    from training.model import load_tokenizer

    rows = [{"question": f"{r['instruction']}\n{r['input']}", "answer": r["output"]} for r in ALPACA]
    dataset_id = _upload(real_client, rows, MAPPING)
    spec = {"base_model": "demo", "dataset_id": dataset_id, "max_seq_len": 32, "micro_batch_size": 4}
    r = real_client.post("/jobs", json=spec | {"max_steps": 100})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    assert r.json()["token_stats"]["status"] == "pending"

    stats = _settled(real_client, job_id)
    assert stats["status"] == "ready" and stats["source"] == "job_created", stats
    # The numbers training computes, from the stored file read through the upload's column mapping.
    path = real_client.app.state.services.storage.dataset_path(dataset_id)  # type: ignore[attr-defined]
    whole = data.tokenize_file(path, load_tokenizer(built_model), MAPPING)
    want = data.token_stats([len(t.input_ids) for t in whole], 32, "truncate")
    assert {k: stats[k] for k in want} == want and stats["count"] == len(ALPACA)
    assert stats["over_max_seq_len"] > 0 and stats["dropped"] == 0
    assert stats["packing"] is True and stats["examples_per_micro_batch"] > 2  # packs hold many examples
    assert stats["steps_per_epoch"] == stats["micro_batches_per_epoch"] < len(ALPACA) / 2
    assert stats["run_epochs"] == round(100 / stats["steps_per_epoch"], 2) > 1  # max_steps in packed steps

    events = [
        e for e in real_client.get(f"/jobs/{job_id}/events").json()["data"] if e["kind"] == "token_stats"
    ]
    assert len(events) == 1 and events[0]["data"]["level"] == "warning"
    msg = events[0]["message"]
    assert msg.startswith(f"warning: token statistics: {len(ALPACA)} examples, p50 {want['p50']} / ")
    assert f"{want['over_max_seq_len']} exceed max_seq_len 32 and will be truncated" in msg
    assert (
        f"{stats['steps_per_epoch']} steps per epoch; the run makes ~{stats['run_epochs']:.3g} epochs" in msg
    )
    with real_client.app.state.services.sessions() as s:  # type: ignore[attr-defined]
        assert workers_db.list_workers(s) == []  # a CPU worker is not in the fleet jobs are planned on


def test_nothing_to_train_on_fails_clearly(real_client: TestClient) -> None:
    rows = [{"prompt": "a long question " * 8, "completion": "an answer"}] * 3
    spec = {"base_model": "demo", "dataset_id": _upload(real_client, rows), "max_seq_len": 8}
    r = real_client.post("/jobs", json=spec)
    assert r.status_code == 202, r.text
    stats = _settled(real_client, r.json()["id"])
    assert stats["status"] == "failed" and stats["error"]["code"] == "invalid_dataset", stats
    assert "no example has tokens to train on within max_seq_len 8" in stats["error"]["message"]
    events = real_client.get(f"/jobs/{r.json()['id']}/events").json()["data"]
    assert events[-1]["kind"] == "token_stats" and "failed (invalid_dataset)" in events[-1]["message"]


def test_a_computation_past_the_timeout_is_killed(stack: Start) -> None:
    client = stack(token_stats_timeout_seconds=0.1)
    r = client.post("/jobs", json={"base_model": "demo", "dataset_id": _upload(client, ALPACA[:5])})
    stats = _settled(client, r.json()["id"], timeout=60)
    assert stats["status"] == "failed" and stats["error"]["code"] == "timeout", stats
