"""Schema migrations, run from code (docs/spec/storage.md).

With SQLite, ``serve`` migrates its own schema; with PostgreSQL ``ballet-planner migrate``
runs as a job, and ``serve`` refuses to start while ``schema_status(...).behind``.

The Alembic configuration is built here rather than read from an ``alembic.ini``, with the
scripts addressed as package data (``service.adapters.store:migrations``), so migrations
run the same from a checkout and from an installed wheel.
"""

from __future__ import annotations

from dataclasses import dataclass

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from service.adapters.store.engine import make_engine, read_only
from service.adapters.store.errors import translated

#: Where the scripts live, as a package resource.
SCRIPT_LOCATION = "service.adapters.store:migrations"

# Serializes concurrent ``migrate`` runs on one PostgreSQL database (two jobs started by
# a rolling deploy): the second waits, then finds the schema at head. Any constant works;
# this one spells "BALLETPL" in ASCII.
_MIGRATION_LOCK_KEY = 0x42414C4C4554504C


@dataclass(frozen=True)
class SchemaStatus:
    """Where a database's schema stands.

    ``current`` is the applied revision (None: an empty database), ``head`` this
    release's latest. ``behind`` is true when migrations of this release are missing; a
    revision this release does not know (a newer release migrated) is not behind.
    """

    current: str | None
    head: str
    behind: bool

    def __str__(self) -> str:
        """Where the schema stands, for an error that says to migrate: ``the database
        schema is behind (at 0005, this release needs 0010)``, or, for an empty database,
        ``... has no tables yet (an empty database, ...)``."""
        where = (
            f"is behind (at {self.current}"
            if self.current
            else "has no tables yet (an empty database"
        )
        return f"the database schema {where}, this release needs {self.head})"


def alembic_config(connection: Connection | None = None) -> Config:
    """The Alembic configuration, optionally bound to an open sync ``connection``
    (``env.py`` migrates over it)."""
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    if connection is not None:
        config.attributes["connection"] = connection
    return config


async def migrate(url: str, *, connect_timeout_s: int = 5) -> None:
    """Upgrade the database at ``url`` (a multi-host URL finds the writable host) to this
    release's head, in one transaction; ``connect_timeout_s`` bounds the connection
    attempt per host.

    Raises ``StoreUnavailable`` when the database cannot be reached.
    """
    engine = make_engine(url, pool_size=1, max_overflow=0, connect_timeout_s=connect_timeout_s)
    try:
        with translated():
            async with engine.begin() as conn:
                await conn.run_sync(_upgrade)
    finally:
        await engine.dispose()


def _upgrade(connection: Connection) -> None:
    if connection.dialect.name == "postgresql":
        # Released when the transaction ends; DDL on PostgreSQL is transactional.
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK_KEY})
    command.upgrade(alembic_config(connection), "head")


async def schema_status(url_or_engine: str | AsyncEngine) -> SchemaStatus:
    """Compare the database's applied revision with this release's head.

    Takes a URL (a short-lived engine is made and disposed) or an engine to borrow.
    Raises ``StoreUnavailable`` when the database cannot be reached.
    """
    engine = (
        make_engine(url_or_engine, pool_size=1, max_overflow=0)
        if isinstance(url_or_engine, str)
        else url_or_engine
    )
    try:
        with translated():
            async with read_only(engine).connect() as conn:
                current = await conn.run_sync(
                    lambda sync: MigrationContext.configure(sync).get_current_revision()
                )
    finally:
        if isinstance(url_or_engine, str):
            await engine.dispose()
    scripts = ScriptDirectory.from_config(alembic_config())
    head = scripts.get_current_head()
    if head is None:
        raise RuntimeError("the planner's migrations have no head revision")
    known = current is not None and _knows(scripts, current)
    behind = current is None or (known and current != head)
    return SchemaStatus(current=current, head=head, behind=behind)


def _knows(scripts: ScriptDirectory, revision: str) -> bool:
    return any(script.revision == revision for script in scripts.walk_revisions())
