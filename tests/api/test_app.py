"""create_app() has no side effects: no file, database or broker is touched until the app starts (its
lifespan), which provisions what requests need and disposes the engine on shutdown."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from api.main import create_app
from core.settings import Settings
from tests.api.conftest import RecordingEnqueuer, RecordingTokenStats

KEY = "ftk_0123456789ab_" + "k" * 32


def test_building_the_app_touches_nothing(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path / "data",
        models_dir=tmp_path / "models",
        database_url=f"sqlite:///{tmp_path / 'ftune.db'}",
        redis_url="redis://127.0.0.1:1/0",  # nothing listens there: a connection attempt would fail
        auth="off",  # used to create tenant "local" while building
        bootstrap_admin_key=KEY,  # used to be stored while building
    )
    create_app(settings)
    assert list(tmp_path.iterdir()) == []  # no data directory, no database file


def test_startup_provisions_and_shutdown_disposes(tmp_path: Path, migrated_url: str) -> None:
    settings = Settings(
        data_dir=tmp_path / "data", models_dir=tmp_path / "models", database_url=migrated_url, auth="off"
    )
    app = create_app(settings, enqueue=RecordingEnqueuer(), token_stats=RecordingTokenStats())
    with TestClient(app) as client:
        assert (tmp_path / "data" / "datasets").is_dir()
        assert client.get("/jobs").status_code == 200  # auth off: the local principal, set at startup
        assert app.state.services.engine.pool.checkedin() >= 1
    assert app.state.services.engine.pool.checkedin() == 0  # disposed
