"""Migrations create exactly the schema ``tables.py`` declares, on PostgreSQL and SQLite,
and ``schema_status`` tells whether a database is behind (docs/spec/limits.md)."""

from __future__ import annotations

from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection

from service.adapters.store import make_engine, migrate, schema_status
from service.adapters.store.migrate import SchemaStatus, alembic_config
from service.adapters.store.tables import metadata
from tests.integration.conftest import DATABASES, HOT


@pytest.fixture(params=[p for p in DATABASES if p.values[0] != HOT])
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """This module's databases: the SQLAlchemy path only (it pins what SQLAlchemy sends,
    or the schema, which the hot path does not change)."""
    if request.param == "postgresql":
        url: str = request.getfixturevalue("pg_url")
        return url
    return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('sqlite') / 'planner.db'}"


def _differences(connection: Connection) -> list[Any]:
    context = MigrationContext.configure(connection, opts={"compare_type": True})
    return list(compare_metadata(context, metadata))


def _indexes(connection: Connection) -> dict[str, set[str]]:
    inspector = inspect(connection)
    return {
        table: {str(index["name"]) for index in inspector.get_indexes(table)}
        for table in metadata.tables
    }


async def test_migrations_create_the_declared_schema(db_url: str) -> None:
    await migrate(db_url)
    engine = make_engine(db_url)
    try:
        async with engine.connect() as conn:
            assert await conn.run_sync(_differences) == []
            indexes = await conn.run_sync(_indexes)
    finally:
        await engine.dispose()
    # compare_metadata ignores partial-index conditions and sort orders; at least every
    # declared index must exist by name.
    for table in metadata.tables.values():
        declared = {str(index.name) for index in table.indexes}
        assert declared <= indexes[table.name], table.name


async def test_migrate_is_idempotent(db_url: str) -> None:
    await migrate(db_url)
    await migrate(db_url)
    status = await schema_status(db_url)
    assert (status.current, status.behind) == (status.head, False)


async def test_schema_status_behind_and_current(db_url: str) -> None:
    empty = await schema_status(db_url)
    assert empty.current is None
    assert empty.behind

    await migrate(db_url)
    engine = make_engine(db_url)
    try:
        current = await schema_status(engine)
        assert current.current == current.head
        assert not current.behind

        async with engine.begin() as conn:
            await conn.run_sync(lambda sync: command.downgrade(alembic_config(sync), "base"))
        assert (await schema_status(engine)).behind

        # A revision this release does not know comes from a newer release: not behind.
        await migrate(db_url)
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE alembic_version SET version_num = 'from-the-future'"))
        newer = await schema_status(engine)
        assert (newer.current, newer.behind) == ("from-the-future", False)
    finally:
        await engine.dispose()


async def test_0004_turns_the_pending_bytes_into_tokens_and_back(db_url: str) -> None:
    """Decision 0171: the running estimate holds tokens; a session stored before holds
    bytes, read from then on as one token per four bytes, rounded up."""
    engine = make_engine(db_url)
    insert_session = text(
        "INSERT INTO sessions (session_id, project_id, organization_id, owner_id, title, "
        "create_time, update_time, summary, summary_up_to, last_sequence, "
        "context_base_tokens, context_pending_bytes, create_request_id, create_request_hash) "
        "VALUES ('s1', 'p', 'o', 'alice', '', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, '', 0, 0, "
        "NULL, 4001, '', '')"
    )
    try:
        async with engine.begin() as conn:
            await conn.run_sync(lambda sync: command.upgrade(alembic_config(sync), "0003"))
            await conn.execute(insert_session)
        await migrate(db_url)
        async with engine.begin() as conn:
            pending = await conn.scalar(text("SELECT context_pending_tokens FROM sessions"))
            assert pending == 1001
            await conn.run_sync(lambda sync: command.downgrade(alembic_config(sync), "0003"))
            pending = await conn.scalar(text("SELECT context_pending_bytes FROM sessions"))
            assert pending == 4004
    finally:
        await engine.dispose()


def test_where_the_schema_stands_reads_as_a_sentence() -> None:
    # An empty database is not "behind (at nothing)" (found by a new-user trial).
    assert str(SchemaStatus(None, "0010", behind=True)) == (
        "the database schema has no tables yet (an empty database, this release needs 0010)"
    )
    assert str(SchemaStatus("0005", "0010", behind=True)) == (
        "the database schema is behind (at 0005, this release needs 0010)"
    )
