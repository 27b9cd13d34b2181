"""``SqlRetentionStore``: the core's ``RetentionStore`` port on SQLAlchemy Core
(``service/core/retention.py``; decisions 0250-0252).

Reads: a window of candidates is one indexed range read without locks
(``ix_sessions_update_time_session_id`` for idle passes, ``ix_sessions_owner_id_session_id``
for an erasure), each row with its latest event's time (a primary-key probe of
``session_events`` at ``last_sequence``) and whether a turn of it runs (the partial
index ``uq_turns_one_running``).

A batch's delete is one transaction, in the lock order of every unit of work (the session
rows first): lock the batch's session rows (PostgreSQL: ``FOR UPDATE SKIP LOCKED``, so a
session being written right now is left for a later batch; SQLite: the write lock every
write transaction holds), re-check the conditions in a statement that sees everything
committed before the locks (a turn's writers lock the session row first, so nothing of
those sessions can change after), count their messages, delete them (the foreign keys
cascade to messages, events and turns). Statements: 4 (lock, re-check, count, delete).
Once the deletion committed, on PostgreSQL each deleted session is announced as
``delete_session`` announces one (``'-1 <replica_id>'`` on the session's channel), by
``signals`` after the commit and outside it (decision 0230).

The pass lock (PostgreSQL) is a session-level advisory lock on a connection of its own,
held for the whole pass: PostgreSQL releases it when that connection ends, however the
process ends. ``exclusively`` runs the pass as one unit of work, so no caller's
cancellation comes between taking the lock and giving it back. SQLite serves one process:
there is no lock, and each batch's re-check under the write lock keeps a second process's
pass (a ``purge`` beside ``serve``) correct, if not exclusive.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Select, and_, delete, exists, func, literal, or_, select
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.adapters.store.engine import is_postgresql, read_only
from service.adapters.store.errors import translated
from service.adapters.store.repository import engine_signals
from service.adapters.store.signals import DELETED_SEQUENCE, Signals
from service.adapters.store.tables import (
    IS_RUNNING,
    chat_streams,
    messages,
    session_events,
    sessions,
    turns,
)
from service.adapters.store.work import UnitsOfWork, every_method_a_unit_of_work
from service.core.retention import Candidate, Deleted, LockCheck, Window

__all__ = ["PASS_LOCK_NAME", "SqlRetentionStore"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The advisory lock of an idle pass is keyed by a 64-bit hash of this name (PostgreSQL).
PASS_LOCK_NAME = "ballet_planner.retention"

_PASS_LOCK_KEY = func.hashtextextended(literal(PASS_LOCK_NAME), 0)

# The time of a session's latest event (NULL when it has none).
_LAST_EVENT_TIME = (
    select(session_events.c.create_time)
    .where(
        session_events.c.session_id == sessions.c.session_id,
        session_events.c.sequence == sessions.c.last_sequence,
    )
    .scalar_subquery()
    .label("last_event_time")
)
_RUNNING = exists().where(turns.c.session_id == sessions.c.session_id, IS_RUNNING).label("running")


def _candidates() -> Select[Any]:
    return select(
        sessions.c.session_id,
        sessions.c.update_time,
        sessions.c.last_sequence,
        _LAST_EVENT_TIME,
        _RUNNING,
    )


def _candidate(row: Row[Any]) -> Candidate:
    activity = row.update_time
    if row.last_event_time is not None and row.last_event_time > activity:
        activity = row.last_event_time
    return Candidate(
        session_id=str(row.session_id),
        last_activity=activity,
        events=int(row.last_sequence),
        running=bool(row.running),
    )


@every_method_a_unit_of_work
class SqlRetentionStore:
    """Retention's reads and deletes on PostgreSQL or SQLite (``engine`` from
    ``make_engine``). ``replica_id`` names this process in the notifications of deleted
    sessions (no spaces), so the replica that deleted skips its own; ``notify`` defaults
    to "on PostgreSQL". Every public method is a unit of work (decision 0180)."""

    def __init__(
        self,
        engine: AsyncEngine,
        replica_id: str,
        *,
        notify: bool | None = None,
        units_of_work: UnitsOfWork | None = None,
    ) -> None:
        if not replica_id or any(ch.isspace() for ch in replica_id):
            raise ValueError(f"replica id {replica_id!r} must be non-empty without spaces")
        self._engine = engine
        self._reader = read_only(engine)
        self._postgresql = is_postgresql(engine)
        if notify and not self._postgresql:
            raise ValueError("notifications need PostgreSQL")
        #: The signals sent after a batch's delete commits (None: none).
        self.signals: Signals | None = None
        if self._postgresql if notify is None else notify:
            self.signals = engine_signals(engine, replica_id)
        self.units_of_work = units_of_work or UnitsOfWork()

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        with translated():
            async with self._engine.begin() as conn:
                yield conn

    @asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncConnection]:
        with translated():
            async with self._reader.connect() as conn:
                yield conn

    # ------------------------------------------------------------------ the pass lock

    async def exclusively(self, work: Callable[[LockCheck], Awaitable[T]]) -> T | None:
        """Run ``work`` holding the pass lock; None at once when another process holds
        it. On SQLite ``work`` runs without a lock. Raises ``StoreUnavailable``."""
        if not self._postgresql:
            return await work(_always_held)
        with translated():
            async with self._engine.connect() as conn:
                taken = await conn.execute(select(func.pg_try_advisory_lock(_PASS_LOCK_KEY)))
                held = bool(taken.scalar_one())
                await conn.commit()
                if not held:
                    return None
                try:
                    return await work(lambda: _still_open(conn))
                finally:
                    await _unlock(conn)

    # ------------------------------------------------------------------ windows

    async def idle_window(self, idle_before: datetime, after: object | None, limit: int) -> Window:
        """Up to ``limit`` sessions with ``update_time`` before ``idle_before``, in
        ``(update_time, session_id)`` order from the cursor ``after``."""
        query = _candidates().where(sessions.c.update_time < idle_before)
        if after is not None:
            if not isinstance(after, tuple):
                raise TypeError(f"not a cursor of idle_window: {after!r}")
            at, session_id = after
            query = query.where(
                or_(
                    sessions.c.update_time > at,
                    and_(sessions.c.update_time == at, sessions.c.session_id > session_id),
                )
            )
        query = query.order_by(sessions.c.update_time, sessions.c.session_id).limit(limit)
        async with self._read() as conn:
            rows = (await conn.execute(query)).all()
        last = rows[-1] if len(rows) == limit else None
        return Window(
            tuple(_candidate(row) for row in rows),
            None if last is None else (last.update_time, str(last.session_id)),
        )

    async def human_window(self, human_id: str, after: object | None, limit: int) -> Window:
        """Up to ``limit`` of ``human_id``'s sessions in id order from the cursor
        ``after``."""
        query = _candidates().where(sessions.c.owner_id == human_id)
        if after is not None:
            query = query.where(sessions.c.session_id > str(after))
        query = query.order_by(sessions.c.session_id).limit(limit)
        async with self._read() as conn:
            rows = (await conn.execute(query)).all()
        return Window(
            tuple(_candidate(row) for row in rows),
            str(rows[-1].session_id) if len(rows) == limit else None,
        )

    # ------------------------------------------------------------------ deleting

    async def delete_sessions(
        self,
        session_ids: Sequence[str],
        *,
        idle_before: datetime | None = None,
        owner_id: str | None = None,
    ) -> Deleted:
        """Delete those of ``session_ids`` that, re-checked on their locked rows, have
        no running turn, were last active before ``idle_before`` (when given) and belong
        to ``owner_id`` (when given), with everything stored under them; one
        transaction, announced to the other replicas once it committed (PostgreSQL)."""
        if not session_ids:
            return Deleted()
        async with self._write() as conn:
            lock = select(sessions.c.session_id).where(sessions.c.session_id.in_(session_ids))
            if owner_id is not None:
                lock = lock.where(sessions.c.owner_id == owner_id)
            if self._postgresql:
                lock = lock.with_for_update(skip_locked=True)
            locked = [str(v) for v in (await conn.execute(lock)).scalars().all()]
            if not locked:
                return Deleted()
            rows = (
                await conn.execute(_candidates().where(sessions.c.session_id.in_(locked)))
            ).all()
            doomed = sorted(
                candidate.session_id
                for candidate in map(_candidate, rows)
                if not candidate.running
                and (idle_before is None or candidate.last_activity < idle_before)
            )
            if not doomed:
                return Deleted()
            held = (
                await conn.execute(select(func.count()).where(messages.c.session_id.in_(doomed)))
            ).scalar_one()
            await conn.execute(delete(sessions).where(sessions.c.session_id.in_(doomed)))
        if self.signals is not None:
            for session_id in doomed:
                self.signals.events(session_id, DELETED_SEQUENCE)
        return Deleted(tuple(doomed), int(held))

    async def count_messages(self, session_ids: Sequence[str]) -> int:
        """Messages stored in those sessions."""
        if not session_ids:
            return 0
        async with self._read() as conn:
            query = select(func.count()).where(messages.c.session_id.in_(session_ids))
            return int((await conn.execute(query)).scalar_one())

    # ------------------------------------------------------------------ one human

    async def running_turns_of(self, human_id: str) -> list[str]:
        """Ids of the running turns ``human_id`` started (``ix_turns_running_human_id``)."""
        async with self._read() as conn:
            query = select(turns.c.turn_id).where(turns.c.human_id == human_id, IS_RUNNING)
            return [str(v) for v in (await conn.execute(query)).scalars().all()]

    async def count_sessions_of(self, human_id: str) -> int:
        """Sessions ``human_id`` owns."""
        async with self._read() as conn:
            query = select(func.count()).where(sessions.c.owner_id == human_id)
            return int((await conn.execute(query)).scalar_one())

    async def stream_slots_of(self, human_id: str, *, delete: bool) -> int:
        """Rows of ``human_id``'s open Chat streams: counted, and deleted with ``delete``.

        A stream whose row is gone no longer counts against its human's limit and ends
        as usual (its own delete of the row then finds nothing); its session, if it was
        one of theirs, is deleted and ends it ``NOT_FOUND``."""
        if not delete:
            async with self._read() as conn:
                query = select(func.count()).where(chat_streams.c.human_id == human_id)
                return int((await conn.execute(query)).scalar_one())
        async with self._write() as conn:
            gone = await conn.execute(
                chat_streams.delete()
                .where(chat_streams.c.human_id == human_id)
                .returning(chat_streams.c.stream_id)
            )
            return len(gone.all())


async def _always_held() -> bool:
    return True


async def _still_open(conn: AsyncConnection) -> bool:
    # The lock lives as long as its connection: a round trip on it tells.
    try:
        await conn.execute(select(literal(1)))
        await conn.commit()
    except Exception:
        await conn.invalidate()
        return False
    return True


async def _unlock(conn: AsyncConnection) -> None:
    if conn.invalidated:
        return  # the lock went with its connection
    try:
        await conn.execute(select(func.pg_advisory_unlock(_PASS_LOCK_KEY)))
        await conn.commit()
    except Exception as error:
        # The connection broke (and the lock with it) or is in doubt: never give it back
        # to the pool with the lock possibly held. What the pass did stays done.
        log.warning("retention: the pass lock's connection failed at its release: %s", error)
        await conn.invalidate()
