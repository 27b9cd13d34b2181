"""Fixtures of the integration tier: the store on a real database.

``db_url`` is parametrized: every test that uses it runs on PostgreSQL (a fresh database
from ``pg_url``) and on SQLite (a file in ``tmp_path``), since the planner supports both
(SPEC section 8). ``engine`` migrates the database first, as ``serve`` would expect.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from service.adapters.store import SqlSessionStore, make_engine, migrate
from tests.integration.store_support import REPLICA


@pytest.fixture(
    params=[
        pytest.param("postgresql", marks=pytest.mark.postgres),
        pytest.param("sqlite"),
    ]
)
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The SQLAlchemy URL of an empty database: PostgreSQL or SQLite."""
    if request.param == "postgresql":
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


@pytest.fixture
def store(engine: AsyncEngine) -> SqlSessionStore:
    """The store of replica ``replica-a`` (notifying on PostgreSQL)."""
    return SqlSessionStore(engine, REPLICA)
