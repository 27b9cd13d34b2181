"""The devstack's database: engine, schema and units of work (SQLite or PostgreSQL).

SQLite (aiosqlite) in the data directory is the default; a ``postgresql+psycopg://`` URL
selects PostgreSQL (README.md: "the same database engine choice as the planner").

Each unit of work gets its own ``AsyncSession`` (docs/contributing.md). On SQLite, write units of
work are serialized by an in-process lock: the devstack is one process, and SQLite allows one
writer, so queueing writers in Python avoids ``database is locked`` errors and stale
WAL snapshots that a deferred transaction would otherwise hit when it starts to write.
On PostgreSQL, concurrent writers are arbitrated by constraints; ``run_write`` retries a
unit of work once when it loses a unique-key race (the retry then sees the winner's row).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from ballet_common.databases import unreachable
from devstack.store.schema import metadata, search_ddl

T = TypeVar("T")
#: An INSERT that can take ``on_conflict_do_update``/``on_conflict_do_nothing``.
Upsert = postgresql.Insert | sqlite.Insert

#: The SQLite file of a data directory.
SQLITE_FILE = "devstack.db"


def sqlite_url(data_dir: Path) -> str:
    """The SQLAlchemy URL of the devstack's SQLite file in ``data_dir``."""
    return f"sqlite+aiosqlite:///{(data_dir / SQLITE_FILE).resolve()}"


class DatabaseUnreachable(ConnectionError):
    """The devstack's database cannot be reached; ``str(error)`` is one line naming what
    was tried (without the password) and why it failed."""


class Store:
    """The database of the three backends; open with ``Store.open`` and ``close`` at the end."""

    def __init__(self, engine: AsyncEngine, url: str = "") -> None:
        self.engine = engine
        self.url = url
        self.dialect = engine.dialect.name
        self._sessions = async_sessionmaker(engine, expire_on_commit=False)
        self._write_lock = asyncio.Lock() if self.dialect == "sqlite" else None

    @classmethod
    async def open(cls, url: str) -> Store:
        """Connect to ``url`` (``sqlite+aiosqlite:///...`` or ``postgresql+psycopg://...``).

        Raises ``ValueError`` for another engine. Does not create the schema.
        """
        parsed = sa.make_url(url)
        backend = parsed.get_backend_name()
        if backend == "sqlite":
            if parsed.drivername != "sqlite+aiosqlite":
                parsed = parsed.set(drivername="sqlite+aiosqlite")
            # A long busy timeout covers the planner or a second reader holding the file.
            engine = create_async_engine(parsed, connect_args={"timeout": 30})
            event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        elif backend == "postgresql":
            if parsed.drivername != "postgresql+psycopg":
                parsed = parsed.set(drivername="postgresql+psycopg")
            engine = create_async_engine(parsed, pool_size=5, max_overflow=10)
        else:
            raise ValueError(f"the devstack runs on SQLite or PostgreSQL, not {backend}")
        return cls(engine, url)

    async def create_schema(self) -> None:
        """Create the tables and the full-text search objects that do not exist yet.

        Raises ``DatabaseUnreachable`` when the database cannot be reached (the first
        statement the devstack sends)."""
        try:
            async with self.engine.begin() as connection:
                await connection.run_sync(metadata.create_all)
                for statement in search_ddl(self.dialect):
                    await connection.exec_driver_sql(statement)
        except (OperationalError, InterfaceError) as error:
            raise DatabaseUnreachable(
                f"{unreachable(self.url, error)}; is the database running there, and is "
                "--database-url right?"
            ) from None

    async def close(self) -> None:
        """Close every pooled connection."""
        await self.engine.dispose()

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncSession]:
        """A read-only unit of work (its transaction is rolled back at the end)."""
        async with self._sessions() as session:
            yield session

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncSession]:
        """A unit of work committed when the block ends without an exception."""
        if self._write_lock is None:
            async with self._sessions() as session, session.begin():
                yield session
            return
        async with self._write_lock, self._sessions() as session, session.begin():
            yield session

    async def run_read(self, work: Callable[[AsyncSession], Awaitable[T]]) -> T:
        """Run ``work`` in one read unit of work and return its result."""
        async with self.read() as session:
            return await work(session)

    async def run_write(self, work: Callable[[AsyncSession], Awaitable[T]]) -> T:
        """Run ``work`` in one write unit of work, retried once after a unique-key race."""
        try:
            async with self.write() as session:
                return await work(session)
        except IntegrityError:
            async with self.write() as session:
                return await work(session)


def upsert(session: AsyncSession, table: sa.Table) -> Upsert:
    """An ``INSERT`` into ``table`` that can take ``on_conflict_do_update``/``_do_nothing``.

    SQLite and PostgreSQL spell upserts the same way in SQLAlchemy, but through
    dialect-specific ``insert`` constructs; this picks the one of the session's engine.
    """
    if session.get_bind().dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets readers run while the one writer writes; NORMAL sync is safe with WAL.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()
