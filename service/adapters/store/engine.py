"""Async engines for the planner's database: PostgreSQL (psycopg 3) or SQLite (aiosqlite).

docs/spec/limits.md: PostgreSQL in production, SQLite as the embedded single-process default
for ``dev`` and first runs.

SQLite needs care to behave like a database with concurrent writers in one process:

- WAL journal, so readers never block the writer and the writer never blocks readers.
- ``busy_timeout``, so a writer waits for the write lock instead of failing at once.
- ``foreign_keys=ON``, which SQLite leaves off per connection; deleting a session relies
  on ``ON DELETE CASCADE``.
- ``BEGIN IMMEDIATE`` for write transactions. With the sqlite3 driver's default
  (deferred) transactions, two writers that both read first deadlock on the upgrade to a
  write lock and one fails with "database is locked" without waiting; taking the write
  lock at BEGIN makes them queue in the busy handler instead. The driver's own
  transaction handling is switched off so SQLAlchemy's ``begin`` event emits the BEGIN
  (the recipe of SQLAlchemy's SQLite dialect documentation).
- Reads (``read_only(engine)``) emit no BEGIN at all: each statement then runs in its own
  implicit read transaction, which in WAL mode never waits for the writer.

A PostgreSQL URL may name several hosts, for a primary and its standbys:
``postgresql+psycopg://user@/db?host=a:5432&host=b:5432&target_session_attrs=read-write``
(SQLAlchemy's form). Every connection the planner opens reads it the same way
(``conninfo`` turns it into libpq's ``host=a,b port=5432,5432 ...``): libpq tries the
hosts in order and, with ``target_session_attrs=read-write``, takes the one that accepts
writes, so after a failover new connections find the promoted standby.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psycopg.conninfo import make_conninfo
from sqlalchemy import event
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from ballet_common.files import check_sqlite_file, create_private_file

#: The execution option that marks an engine (or connection) as read-only: PostgreSQL
#: reads then run in autocommit, SQLite reads without BEGIN.
READ_ONLY_OPTION = "ballet_read_only"


@dataclass(frozen=True)
class SocketBounds:
    """The socket-level bounds of every PostgreSQL connection the planner opens (the two
    pools, the LISTEN connection, migrate), in seconds (decision 0310).

    ``tcp_user_timeout_s`` (libpq's ``tcp_user_timeout``, Linux ``TCP_USER_TIMEOUT``):
    data sent and not acknowledged for that long aborts the connection, so a statement
    on a connection whose peer went silent fails instead of waiting on TCP's
    retransmissions (about 15 minutes), and data the kernel still holds is never
    delivered later. Keepalives (idle, interval, count) find a silent peer of an idle
    connection (the LISTEN connection, a pooled one) after about ``keepalives_idle_s`` +
    ``tcp_user_timeout_s``: with a user timeout set, Linux lets it decide when the unanswered
    probes end the connection.
    """

    tcp_user_timeout_s: float = 8.0
    keepalives_idle_s: int = 5
    keepalives_interval_s: int = 2
    keepalives_count: int = 3

    def libpq(self) -> dict[str, int]:
        """The libpq parameters (``tcp_user_timeout`` in milliseconds)."""
        return {
            "keepalives": 1,
            "keepalives_idle": self.keepalives_idle_s,
            "keepalives_interval": self.keepalives_interval_s,
            "keepalives_count": self.keepalives_count,
            "tcp_user_timeout": max(1, round(self.tcp_user_timeout_s * 1000)),
        }


#: The defaults of ``database.tcp_user_timeout_s`` and ``database.keepalives_*``.
SOCKET_BOUNDS = SocketBounds()


def conninfo(url: str) -> str:
    """The libpq connection string of a PostgreSQL URL (SQLAlchemy's
    ``postgresql+psycopg://...`` form, several ``host=`` query keys included, or a libpq
    URL), for the connections opened with psycopg directly (the hot path's pool, the
    LISTEN connection). Raises ``ValueError`` for another backend."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        raise ValueError(f"not a PostgreSQL URL: {parsed!r}")
    # SQLAlchemy's own reading of its URL (host lists, query keys), so the psycopg
    # connections and the engine's agree; the dialect class carries no annotations.
    dialect: Any = PGDialect_psycopg
    _, kwargs = dialect().create_connect_args(parsed)
    return make_conninfo("", **kwargs)


def connect_args(
    *,
    connect_timeout_s: int,
    application_name: str,
    bounds: SocketBounds = SOCKET_BOUNDS,
    **more: Any,
) -> dict[str, Any]:
    """The libpq parameters every PostgreSQL connection of the planner adds to its URL's:
    ``connect_timeout_s`` bounds each host's connection attempt (libpq applies it per
    host, so a dead primary costs at most that before the next host is tried), the
    application name, the socket bounds (``SocketBounds``: keepalives and the TCP user
    timeout), and ``more``."""
    return {
        "connect_timeout": connect_timeout_s,
        "application_name": application_name,
        **bounds.libpq(),
        **more,
    }


def is_postgresql(engine: AsyncEngine) -> bool:
    """Whether the engine talks to PostgreSQL (else SQLite)."""
    return engine.dialect.name == "postgresql"


def prepare_sqlite_file(url: str) -> None:
    """Create the SQLite file of ``url`` ``0600`` (its directory ``0700`` when made here)
    before SQLite opens it, whatever the umask: it holds transcripts. SQLite
    gives its WAL and journal files the database file's mode. An existing file is left
    as it is, but checked: raises ``DatabaseFileError`` (one line naming the file) when it
    is not a SQLite database or is damaged. A ``:memory:`` database and other engines are
    left alone."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return
    path = Path(parsed.database)
    if not create_private_file(path):
        check_sqlite_file(path)


def make_engine(
    url: str,
    *,
    pool_size: int = 10,
    max_overflow: int = 10,
    pool_timeout_s: float = 10.0,
    pool_pre_ping: bool = False,
    connect_timeout_s: int = 5,
    sqlite_busy_timeout_ms: int = 10_000,
    application_name: str = "ballet-planner",
    echo: bool = False,
    bounds: SocketBounds = SOCKET_BOUNDS,
) -> AsyncEngine:
    """An ``AsyncEngine`` for ``url``: ``postgresql+psycopg://...`` or
    ``sqlite+aiosqlite:///path`` (a file; ``:memory:`` is one connection's private
    database and cannot be shared by a pool).

    ``pool_size``/``max_overflow`` bound the connections; a unit of work that waits
    longer than ``pool_timeout_s`` seconds for one fails (the store turns that into
    ``StoreUnavailable``). ``pool_pre_ping`` costs one round trip per checkout and is off
    by default: after a database restart the first statement on a stale connection fails
    and SQLAlchemy then discards every pooled connection, so the pool heals after one
    failed unit of work; on it, every checkout first checks its connection, so no unit
    of work meets a connection a failover left broken. ``connect_timeout_s`` bounds a
    PostgreSQL connection attempt per host, so an unreachable server fails fast instead
    of hanging a turn; ``bounds`` are its sockets' (``SocketBounds``). Raises
    ``ValueError`` for any other backend.
    """
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        if parsed.get_driver_name() != "psycopg":
            raise ValueError(f"use the psycopg driver (postgresql+psycopg://), not {url!r}")
        engine = create_async_engine(
            parsed,
            pool_size=pool_size,
            max_overflow=max_overflow,
            pool_timeout=pool_timeout_s,
            pool_pre_ping=pool_pre_ping,
            echo=echo,
            connect_args=connect_args(
                connect_timeout_s=connect_timeout_s,
                application_name=application_name,
                bounds=bounds,
            ),
        )
        return engine
    if backend == "sqlite":
        if parsed.get_driver_name() != "aiosqlite":
            raise ValueError(f"use the aiosqlite driver (sqlite+aiosqlite:///), not {url!r}")
        if parsed.database in (None, "", ":memory:"):
            raise ValueError("SQLite needs a database file, not an in-memory database")
        engine = create_async_engine(
            parsed,
            pool_size=pool_size,
            max_overflow=max_overflow,
            pool_timeout=pool_timeout_s,
            pool_pre_ping=pool_pre_ping,
            echo=echo,
        )
        _configure_sqlite(engine, busy_timeout_ms=sqlite_busy_timeout_ms)
        return engine
    raise ValueError(f"unsupported database URL {url!r}: use PostgreSQL or SQLite")


def read_only(engine: AsyncEngine) -> AsyncEngine:
    """A view of ``engine`` (same pool) for units of work that only read.

    On PostgreSQL its connections run in autocommit, which saves the BEGIN and COMMIT
    round trips of a one-statement read; on SQLite no BEGIN is emitted (see the module
    docstring). A multi-statement read then sees each statement's own snapshot.
    """
    if is_postgresql(engine):
        return engine.execution_options(isolation_level="AUTOCOMMIT", **{READ_ONLY_OPTION: True})
    return engine.execution_options(**{READ_ONLY_OPTION: True})


def _configure_sqlite(engine: AsyncEngine, *, busy_timeout_ms: int) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from the sqlite3 driver (see the module docstring).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
            cursor.execute("PRAGMA foreign_keys=ON")
            # In WAL mode NORMAL loses no data on a process crash, only possibly the last
            # commits on a power loss; the embedded default is for development.
            cursor.execute("PRAGMA synchronous=NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(connection: Connection) -> None:
        if connection.get_execution_options().get(READ_ONLY_OPTION):
            return
        connection.exec_driver_sql("BEGIN IMMEDIATE")
