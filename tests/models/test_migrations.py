"""The schema is created only by Alembic, and the head revision matches the ORM metadata."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from models.db import make_engine
from models.migrate import downgrade, upgrade
from models.tables import Base


def test_upgrade_downgrade_upgrade_matches_metadata(database_url: str) -> None:
    upgrade(database_url)
    downgrade(database_url, "base")
    engine = make_engine(database_url)
    try:
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        upgrade(database_url)
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == [], f"models and migrations differ: {diff}"
        assert {"datasets", "jobs", "job_events", "artifacts"} <= set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
