"""A job on a real migrated database and a stand-in training command, for JobRunner tests."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy.orm import sessionmaker

from core.settings import Settings
from core.spec import JobSpec
from core.storage import new_id
from models import datasets as datasets_db
from models import jobs as jobs_db
from models.db import make_engine, make_session_factory, session_scope
from models.tenants import get_or_create_tenant


def stand_in_training(body: str) -> Callable[[Path], list[str]]:
    """A training command: Python that finds its output dir in run.json as training.run does (`out`),
    then runs `body` (one line of ';'-separated statements)."""
    head = (
        "import json, pathlib, sys; "
        "out = pathlib.Path(json.loads(pathlib.Path(sys.argv[1]).read_text())['output_dir']); "
        "out.mkdir(parents=True, exist_ok=True); "
    )
    return lambda run_json: [sys.executable, "-c", head + body, str(run_json)]


# A few MB to plan: any worker's RAM fits it (placement re-plans a job on the claiming worker).
TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


@contextmanager
def job_in_db(
    tmp_path: Path,
    database_url: str,
    spec: dict[str, Any],
    settings: dict[str, Any] | None = None,
    **job: Any,
) -> Iterator[tuple[Settings, sessionmaker, str]]:
    """Settings, a session factory and the id of a queued job (base model "tiny", a 'valid' text dataset
    of `spec`'s dataset), created with `job` as create_job's keyword arguments."""
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "models" / "tiny" / "config.json").write_text(json.dumps(TINY_LLAMA))
    config = Settings(
        data_dir=tmp_path / "data",
        models_dir=tmp_path / "models",
        database_url=database_url,
        progress_interval_seconds=0.05,
        **(settings or {}),
    )
    engine = make_engine(database_url)
    sessions = make_session_factory(engine)
    with session_scope(sessions) as s:
        tenant = get_or_create_tenant(s, "acme")
        dataset_id = new_id()
        report = {"valid": True, "format": "text", "num_examples": 4, "size_bytes": 10, "sha256": "0" * 64}
        datasets_db.create_dataset(s, tenant.id, dataset_id, "d.jsonl", report)
        job_id = new_id()
        jobs_db.create_job(
            s, tenant.id, job_id, JobSpec(base_model="tiny", dataset_id=dataset_id, **spec), **job
        )
    try:
        yield config, sessions, job_id
    finally:
        engine.dispose()
