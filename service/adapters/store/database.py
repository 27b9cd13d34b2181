"""The planner's database as the composition root opens it: the engine, on PostgreSQL
the hot path's pool, and the two stores on them (decision 0113).

Connections per replica on PostgreSQL, at most: ``database.pool_size`` +
``database.max_overflow`` (SQLAlchemy: sessions, listings, recovery, stream
heartbeats) + ``database.hot_pool_size`` (psycopg: every turn's and every Chat
stream's units of work; also the notifications sent after commits, one at a time,
``signals.py``) + 1 (the LISTEN connection of ``adapters.bus``). PostgreSQL's
``max_connections`` must exceed that times the number of replicas, plus what migrations
and operators use.

Both stores run their units of work in one ``UnitsOfWork`` (``work.py``): no caller's
cancellation reaches a connection, and ``close`` waits for the units in flight before
the pools close (decision 0180).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from psycopg_pool import AsyncConnectionPool
from sqlalchemy.ext.asyncio import AsyncEngine

from service.adapters.store.engine import SOCKET_BOUNDS, SocketBounds, is_postgresql, make_engine
from service.adapters.store.pg import PgSessionStore, PgStreamStore, StatementObserver, make_pool
from service.adapters.store.repository import SqlSessionStore
from service.adapters.store.streams import SqlStreamStore
from service.adapters.store.work import ABANDONED_READ_GRACE_S, UnitsOfWork
from service.core.errors import StoreUnavailable
from service.core.ports import Tracer
from service.core.tracing import NULL_TRACER


@dataclass
class Database:
    """An open database: ``sessions`` and ``streams`` are the core's ports on it."""

    engine: AsyncEngine
    pool: AsyncConnectionPool[Any] | None
    sessions: SqlSessionStore
    streams: SqlStreamStore
    units_of_work: UnitsOfWork
    observers: list[StatementObserver] = field(default_factory=list)

    def observe(self, observer: StatementObserver) -> Callable[[], None]:
        """Call ``observer(statement, rows)`` after each statement of the hot path (the
        rest of the store goes through SQLAlchemy, whose engine events see it); returns a
        function that stops it."""
        self.observers.append(observer)
        return lambda: self.observers.remove(observer) if observer in self.observers else None

    def checked_out(self) -> int:
        """Connections in use right now, in both pools."""
        used = 0
        checkedout = getattr(self.engine.sync_engine.pool, "checkedout", None)
        if callable(checkedout):
            used += int(checkedout())
        if self.pool is not None:
            stats = self.pool.get_stats()
            used += stats.get("pool_size", 0) - stats.get("pool_available", 0)
        return used

    async def close(self, timeout_s: float = 5.0) -> None:
        """Wait up to ``timeout_s`` seconds for the units of work in flight (a caller
        that left does not stop one, decision 0180), cancel what is left, then close the
        pools."""
        await self.units_of_work.drain(timeout_s)
        signals = self.sessions.signals
        if signals is not None:
            # The last commits' signals, if the cluster takes them; followers heal the rest.
            await signals.flush(min(timeout_s, 1.0))
            await signals.close()
        if self.pool is not None:
            await self.pool.close()
        await self.engine.dispose()


async def open_database(
    url: str,
    *,
    replica_id: str,
    pool_size: int = 10,
    max_overflow: int = 10,
    hot_pool_size: int = 20,
    pool_timeout_s: float = 10.0,
    connect_timeout_s: int = 5,
    pool_pre_ping: bool = False,
    abandoned_read_grace_s: float = ABANDONED_READ_GRACE_S,
    unit_timeout_s: float | None = None,
    bounds: SocketBounds = SOCKET_BOUNDS,
    context_cache_bytes: int = 64 << 20,
    tracer: Tracer = NULL_TRACER,
) -> Database:
    """Open ``url`` (PostgreSQL or SQLite; ``make_engine`` says which URLs, a multi-host
    PostgreSQL URL included) with the stores of replica ``replica_id``. On PostgreSQL the
    hot path's pool is opened with one connection at once, so a database that cannot be
    reached fails here (``StoreUnavailable``) rather than at the first turn.
    ``pool_timeout_s``, ``connect_timeout_s`` (seconds, per host) and ``pool_pre_ping``
    apply to both pools; a read whose caller left is cancelled after
    ``abandoned_read_grace_s`` seconds (``work.py``); every unit of work fails
    ``StoreUnavailable`` past ``unit_timeout_s`` seconds (None: no deadline) and every
    PostgreSQL socket has ``bounds`` (decision 0310). ``tracer`` traces the units of
    work."""
    engine = make_engine(
        url,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_timeout_s=pool_timeout_s,
        pool_pre_ping=pool_pre_ping,
        connect_timeout_s=connect_timeout_s,
        bounds=bounds,
    )
    work = UnitsOfWork(
        tracer, abandoned_read_grace_s=abandoned_read_grace_s, unit_timeout_s=unit_timeout_s
    )
    if not is_postgresql(engine):
        sessions = SqlSessionStore(
            engine, replica_id, context_cache_bytes=context_cache_bytes, units_of_work=work
        )
        return Database(engine, None, sessions, SqlStreamStore(engine, units_of_work=work), work)
    pool = make_pool(
        url,
        max_size=hot_pool_size,
        timeout_s=pool_timeout_s,
        connect_timeout_s=connect_timeout_s,
        pre_ping=pool_pre_ping,
        bounds=bounds,
    )
    try:
        await pool.open(wait=True, timeout=pool_timeout_s)
    except Exception as error:
        await pool.close()
        await engine.dispose()
        raise StoreUnavailable(f"the database is unreachable: {error}") from error
    observers: list[StatementObserver] = []
    return Database(
        engine,
        pool,
        PgSessionStore(
            engine,
            pool,
            replica_id,
            context_cache_bytes=context_cache_bytes,
            units_of_work=work,
            observers=observers,
        ),
        PgStreamStore(engine, pool, units_of_work=work, observers=observers),
        work,
        observers,
    )
