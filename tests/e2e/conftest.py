"""Fixtures shared by the end-to-end tests: the demo model, built once per session by the real CLI, and one
`ftune up` stack for the tests that drive the service as `make up` runs it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.stack import REPO, Up, env_for, ftune_up

_built: list[Path] = []  # other packages import `models_dir` (a fixture of their own): one build for all


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo base model, built by `ftune models build-demo` once for the test session."""
    if not _built:
        tmp = tmp_path_factory.mktemp("models")
        env = env_for(tmp, tmp / "models")
        subprocess.run([sys.executable, "-m", "cli", "models", "build-demo"], env=env, check=True, cwd=REPO)
        _built.append(tmp / "models")
    return _built[0]


@pytest.fixture(scope="package")
def up(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Up]:
    """One `ftune up` (default settings: the 120 s lease, SQLite, the embedded broker) for the package's
    tests, started once; its teardown checks that Ctrl-C stops everything cleanly (see ftune_up). Every
    test submits as the admin tenant and waits for its own jobs, so tests never wait on each other's."""
    with ftune_up(tmp_path_factory.mktemp("up"), models_dir) as stack:
        yield stack


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """Each phase's report on the test item (`item.rep_call`): a fixture shared by several tests prints its
    processes' logs after a test that failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
