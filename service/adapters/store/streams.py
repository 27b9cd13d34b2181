"""``SqlStreamStore``: the core's ``StreamStore`` port on SQLAlchemy Core (docs/spec/limits.md).

Open Chat streams are rows of ``chat_streams``; each replica's heartbeat lease is a row of
``planner_replicas`` (docs/decisions/0080-cross-replica-stream-count.md). A stream
counts only while its replica's lease holds, and forgetting a replica cascades to its
streams.

Admission is exact across replicas: ``open_stream`` counts the human's streams and
inserts the new one in one transaction, serialized per human. On PostgreSQL a
transaction-scoped advisory lock keyed by the human does that (two humans rarely share a
key, and sharing one only makes them wait for each other); on SQLite every write
transaction already holds the database's one write lock (``BEGIN IMMEDIATE``, see
``engine``). Statements: ``open_stream`` 3 on PostgreSQL (lock, count, insert), 2 on
SQLite; ``close_streams`` 1; ``remove_replica`` 2; ``sweep_replicas`` 1 (2 when one
was swept); ``heartbeat`` 1 (2 on the first beat); ``replica_streams``
1.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Select, delete, func, insert, literal, select, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.adapters.store.engine import is_postgresql, read_only
from service.adapters.store.errors import translated
from service.adapters.store.tables import chat_streams, planner_replicas, session_follows
from service.adapters.store.work import UnitsOfWork, every_method_a_unit_of_work, read_unit
from service.core.errors import StoreConflict
from service.core.ports import OpenStream

__all__ = ["SqlStreamStore"]

#: Prefix of the advisory-lock key of one human's stream count (PostgreSQL).
_LOCK_PREFIX = "ballet_planner.chat_streams:"


@every_method_a_unit_of_work
class SqlStreamStore:
    """The ``StreamStore`` port on PostgreSQL or SQLite (``engine`` from ``make_engine``,
    shared with ``SqlSessionStore``). Every public method is one unit of work run by
    ``units_of_work``, which no caller's cancellation reaches (``work.py``)."""

    def __init__(self, engine: AsyncEngine, *, units_of_work: UnitsOfWork | None = None) -> None:
        self._engine = engine
        self._reader = read_only(engine)
        self._postgresql = is_postgresql(engine)
        #: Runs every public method, which no caller's cancellation reaches (``work.py``).
        self.units_of_work = units_of_work or UnitsOfWork()

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        with translated():
            async with self._engine.begin() as conn:
                yield conn

    async def heartbeat(self, replica_id: str, lease_expires_at: datetime) -> bool:
        """Extend the replica's lease; create its row when missing and return False then.

        Raises ``StoreUnavailable``.
        """
        until = _utc(lease_expires_at)
        async with self._write() as conn:
            renewed = (
                await conn.execute(
                    update(planner_replicas)
                    .where(planner_replicas.c.replica_id == replica_id)
                    .values(lease_expires_at=until)
                    .returning(planner_replicas.c.replica_id)
                )
            ).first()
            if renewed is not None:
                return True
            # Two beats may race here (the loop's, and an open that found the row gone).
            dialect_insert = postgresql.insert if self._postgresql else sqlite.insert
            await conn.execute(
                dialect_insert(planner_replicas)
                .values(replica_id=replica_id, lease_expires_at=until)
                .on_conflict_do_update(
                    index_elements=[planner_replicas.c.replica_id],
                    set_={"lease_expires_at": until},
                )
            )
        return False

    async def open_stream(self, stream: OpenStream, *, limit: int, now: datetime) -> bool:
        """Insert ``stream`` unless its human has ``limit`` streams on live replicas.

        Returns False (nothing stored) when refused. Raises ``StoreConflict`` when the
        stream's replica has no row (swept after a lapse: heartbeat, then retry) and
        ``StoreUnavailable``.
        """
        try:
            async with self._write() as conn:
                if self._postgresql:
                    key = func.hashtextextended(literal(_LOCK_PREFIX + stream.human_id), 0)
                    await conn.execute(select(func.pg_advisory_xact_lock(key)))
                live = _live_count(stream.human_id, now)
                if int((await conn.execute(live)).scalar_one()) >= limit:
                    return False
                await conn.execute(insert(chat_streams).values(_row(stream)))
        except sa_exc.IntegrityError as error:
            # The only constraint an insert of a fresh uuid can break is the replica's
            # foreign key.
            raise StoreConflict(f"replica {stream.replica_id} is not registered") from error
        return True

    async def close_streams(self, stream_ids: Sequence[str]) -> None:
        """Delete the streams' rows (unknown ids are ignored). Raises ``StoreUnavailable``."""
        if not stream_ids:
            return
        async with self._write() as conn:
            await conn.execute(delete(chat_streams).where(chat_streams.c.stream_id.in_(stream_ids)))

    async def restore_streams(self, replica_id: str, streams: Sequence[OpenStream]) -> None:
        """Insert the rows of streams still open on ``replica_id`` (after ``heartbeat``
        re-created its row); rows that exist are kept. Raises ``StoreUnavailable``."""
        rows = [_row(stream) for stream in streams if stream.replica_id == replica_id]
        if not rows:
            return
        dialect_insert = postgresql.insert if self._postgresql else sqlite.insert
        async with self._write() as conn:
            await conn.execute(dialect_insert(chat_streams).values(rows).on_conflict_do_nothing())

    @read_unit
    async def replica_streams(self, replica_id: str) -> list[str]:
        """The ids of the streams recorded for ``replica_id`` (one indexed read). Raises
        ``StoreUnavailable``."""
        with translated():
            async with self._reader.connect() as conn:
                rows = await conn.execute(
                    select(chat_streams.c.stream_id).where(chat_streams.c.replica_id == replica_id)
                )
                return [str(row.stream_id) for row in rows]

    async def remove_replica(self, replica_id: str) -> None:
        """Delete the replica's row and, by cascade, its streams, and the sessions it
        followed (``session_follows``). Raises ``StoreUnavailable``."""
        async with self._write() as conn:
            await conn.execute(
                delete(planner_replicas).where(planner_replicas.c.replica_id == replica_id)
            )
            # The sessions it followed (decision 0340): nobody listens there any more.
            await conn.execute(
                delete(session_follows).where(session_follows.c.replica_id == replica_id)
            )

    async def sweep_replicas(self, now: datetime) -> int:
        """Delete replicas whose lease expired before ``now`` and, by cascade, their
        streams, and the sessions they followed; returns how many. Raises
        ``StoreUnavailable``."""
        async with self._write() as conn:
            gone = (
                await conn.execute(
                    delete(planner_replicas)
                    .where(planner_replicas.c.lease_expires_at < _utc(now))
                    .returning(planner_replicas.c.replica_id)
                )
            ).all()
            if gone:
                ids = [str(row.replica_id) for row in gone]
                await conn.execute(
                    delete(session_follows).where(session_follows.c.replica_id.in_(ids))
                )
        return len(gone)

    @read_unit
    async def count_streams(self, human_id: str, now: datetime) -> int:
        """The human's streams on replicas whose lease holds at ``now`` (operations and
        tests)."""
        with translated():
            async with self._reader.connect() as conn:
                return int((await conn.execute(_live_count(human_id, now))).scalar_one())


def _live_count(human_id: str, now: datetime) -> Select[Any]:
    """The human's streams on replicas whose lease holds at ``now``."""
    return (
        select(func.count())
        .select_from(
            chat_streams.join(
                planner_replicas, planner_replicas.c.replica_id == chat_streams.c.replica_id
            )
        )
        .where(
            chat_streams.c.human_id == human_id,
            planner_replicas.c.lease_expires_at > _utc(now),
        )
    )


def _row(stream: OpenStream) -> dict[str, object]:
    return {
        "stream_id": stream.stream_id,
        "human_id": stream.human_id,
        "replica_id": stream.replica_id,
        "opened_at": _utc(stream.opened_at),
    }


def _utc(moment: datetime) -> datetime:
    if moment.tzinfo is None:
        raise ValueError(f"naive datetime {moment!r}: the store needs aware times")
    return moment.astimezone(UTC)
