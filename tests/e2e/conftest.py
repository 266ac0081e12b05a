"""Fixtures shared by the end-to-end tests: the demo model, built once per session by the real CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.stack import REPO, env_for


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo base model, built by `ftune models build-demo` once for the test session."""
    tmp = tmp_path_factory.mktemp("models")
    env = env_for(tmp, tmp / "models")
    subprocess.run([sys.executable, "-m", "cli", "models", "build-demo"], env=env, check=True, cwd=REPO)
    return tmp / "models"
