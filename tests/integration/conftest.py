"""Fixtures of the integration tier: the store on a real database.

``db_url`` is parametrized: every test that uses it runs on PostgreSQL (a fresh database
from ``pg_url``) and on SQLite (a file in ``tmp_path``), since the planner supports both
(docs/spec/storage.md); on PostgreSQL twice, once with the stores on SQLAlchemy alone and once
with the hot path on psycopg (``postgresql-hot``, decision 0113), which is what ``serve``
runs. ``engine`` migrates the database first, as ``serve`` would expect.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from psycopg_pool import AsyncConnectionPool
from sqlalchemy.ext.asyncio import AsyncEngine

from service.adapters.store import SqlSessionStore, make_engine, migrate
from service.adapters.store.pg import PgSessionStore, PgStreamStore, make_pool
from service.adapters.store.streams import SqlStreamStore
from tests.integration.store_support import REPLICA

HOT = "postgresql-hot"
DATABASES = [
    pytest.param("postgresql", marks=pytest.mark.postgres),
    pytest.param(HOT, marks=pytest.mark.postgres),
    pytest.param("sqlite"),
]


@pytest.fixture(params=DATABASES)
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The SQLAlchemy URL of an empty database: PostgreSQL or SQLite."""
    if request.param in ("postgresql", HOT):
        url: str = request.getfixturevalue("pg_url")
        return url
    return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('sqlite') / 'planner.db'}"


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    """A migrated database's engine, disposed after the test."""
    await migrate(db_url)
    engine = make_engine(db_url)
    try:
        yield engine
    finally:
        await engine.dispose()


def _hot(request: pytest.FixtureRequest) -> bool:
    callspec = getattr(request.node, "callspec", None)
    return callspec is not None and callspec.params.get("db_url") == HOT


@pytest.fixture
async def hot_pool(
    request: pytest.FixtureRequest, engine: AsyncEngine, db_url: str
) -> AsyncIterator[AsyncConnectionPool | None]:
    """The hot path's pool on ``postgresql-hot``; None elsewhere."""
    if not _hot(request):
        yield None
        return
    pool = make_pool(db_url, max_size=20, timeout_s=10)
    await pool.open(wait=True)
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
def store(engine: AsyncEngine, hot_pool: AsyncConnectionPool | None) -> SqlSessionStore:
    """The store of replica ``replica-a`` (notifying on PostgreSQL)."""
    if hot_pool is not None:
        return PgSessionStore(engine, hot_pool, REPLICA)
    return SqlSessionStore(engine, REPLICA)


@pytest.fixture
def streams(engine: AsyncEngine, hot_pool: AsyncConnectionPool | None) -> SqlStreamStore:
    """The stream store, with the hot path on ``postgresql-hot``."""
    if hot_pool is not None:
        return PgStreamStore(engine, hot_pool)
    return SqlStreamStore(engine)
