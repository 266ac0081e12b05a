"""Fixtures shared by the worker's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy.orm import Session, sessionmaker

from models.db import make_engine, make_session_factory


@pytest.fixture
def sessions(migrated_url: str) -> Iterator[sessionmaker[Session]]:
    """Sessions on a migrated database (SQLite, and PostgreSQL when it runs: see tests/conftest.py)."""
    engine = make_engine(migrated_url)
    try:
        yield make_session_factory(engine)
    finally:
        engine.dispose()
