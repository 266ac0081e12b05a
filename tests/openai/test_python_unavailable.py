"""An API server that enabled python graders on a kernel that refuses namespaces (a seccomp filter like
Docker's default profile, tests/core/no_namespaces.py): its sandbox cannot isolate a grader, so python
graders are refused with a 400 python_grader_unavailable naming why, by graders/validate, graders/run and
job admission alike; every other grader still grades."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.e2e.stack import REPO, env_for, free_port
from tests.openai.conftest import ALPACA, TINY, Server, _healthy
from tests.openai.test_graders_api import CAPITAL, EXACT_PY, refused

pytestmark = pytest.mark.slow

PYTHON: Any = {"type": "python", "name": "exact", "source": EXACT_PY}
CHECK: Any = CAPITAL


@pytest.fixture(scope="module")
def caged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("no-namespaces")
    (tmp / "models" / "tiny").mkdir(parents=True)
    (tmp / "models" / "tiny" / "config.json").write_text(json.dumps(TINY))
    port, database_url = free_port(), f"sqlite:///{tmp / 'ftune.db'}"
    env = env_for(tmp, tmp / "models", FTUNE_API_PORT=str(port), FTUNE_DATABASE_URL=database_url)
    env |= {"FTUNE_PYTHON_GRADER_ENABLED": "1"}
    subprocess.run([sys.executable, "-m", "cli", "migrate"], env=env, check=True, cwd=REPO)
    wrapper = [sys.executable, "-m", "tests.core.no_namespaces", sys.executable, "-m", "cli", "api"]
    log = tmp / "api.log"
    with log.open("wb") as out:
        api = subprocess.Popen(wrapper, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _healthy(base):
            assert api.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield Server(base, tmp / "data", database_url)
    finally:
        api.terminate()
        api.wait(60)


@pytest.fixture
def sdk(caged: Server) -> Iterator[openai.OpenAI]:
    client, native = caged.tenant()
    native.close()
    with client:
        yield client


def test_graders_validate_and_run_refuse_python_naming_why(sdk: openai.OpenAI) -> None:
    graders = sdk.fine_tuning.alpha.graders
    multi: Any = {
        "type": "multi",
        "graders": {"capital": CAPITAL, "exact": PYTHON},
        "calculate_output": "exact",
    }
    calls: list[tuple[Any, str]] = [
        (lambda: graders.validate(grader=PYTHON), "grader.type"),
        (lambda: graders.run(grader=PYTHON, model_sample="Paris", item={"answer": "Paris"}), "grader.type"),
        (lambda: graders.validate(grader=multi), "grader.graders.exact.type"),
    ]
    for call, param in calls:
        message = refused(call, "python_grader_unavailable", param)
        assert "unshare: Operation not permitted" in message, message
    assert graders.run(grader=CHECK, model_sample="Paris", item={"answer": "Paris"}).reward == 1.0


def test_a_job_with_a_python_grader_is_refused_at_admission(sdk: openai.OpenAI) -> None:
    file_id = sdk.files.create(file=("alpaca.jsonl", ALPACA), purpose="fine-tune").id
    method: Any = {"type": "reinforcement", "reinforcement": {"grader": PYTHON}}
    message = refused(
        lambda: sdk.fine_tuning.jobs.create(model="tiny", training_file=file_id, method=method),
        "python_grader_unavailable",
        "grader.type",
    )
    assert "unshare: Operation not permitted" in message, message
    assert sdk.fine_tuning.jobs.list().data == []
