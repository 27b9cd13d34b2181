"""Callers of the store cancelled at any point (decision 0180), on PostgreSQL
(SQLAlchemy and the psycopg hot path) and SQLite.

Each unit of work runs in a task its store owns and its caller awaits it shielded, so a
caller cancelled once, or again while it would be cleaning up, never interrupts a
statement, a rollback or the return of a connection: when the units in flight are done,
both pools have nothing checked out, PostgreSQL has no connection of the planner idle in
a transaction, and SQLAlchemy never hands a connection to the garbage collector.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import warnings
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.adapters.store import SqlSessionStore
from service.adapters.store.streams import SqlStreamStore
from service.core.errors import PlannerError, StoreConflict
from service.core.model import TurnState
from service.core.ports import OpenStream
from tests.integration.store_support import (
    REPLICA,
    T0,
    end_commit,
    new_session,
    turn_start,
    unique,
)

CALLERS = 300


def checked_out(engine: AsyncEngine, pool: AsyncConnectionPool[Any] | None) -> int:
    used = int(engine.sync_engine.pool.checkedout())  # type: ignore[attr-defined]
    if pool is not None:
        stats = pool.get_stats()
        used += stats.get("pool_size", 0) - stats.get("pool_available", 0)
    return used


async def yield_loop(times: int) -> None:
    """Let the event loop run ``times`` rounds: a cancel lands at a random step of the
    caller (a point in the program, not a wait for anything)."""
    for _ in range(times):
        await asyncio.sleep(0)


async def test_callers_cancelled_at_any_point_leave_no_connection_checked_out(
    store: SqlSessionStore,
    streams: SqlStreamStore,
    engine: AsyncEngine,
    hot_pool: AsyncConnectionPool[Any] | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    rng = random.Random(12)
    await streams.heartbeat(REPLICA, T0 + timedelta(days=3650))
    shared = unique("s")
    await store.create_session(new_session(shared))

    async def turn() -> None:
        session_id, turn_id = unique("s"), unique("t")
        await store.create_session(new_session(session_id))
        await store.start_turn(turn_start(session_id, turn_id))
        await store.commit(end_commit(session_id, turn_id))

    async def stream() -> None:
        opened = OpenStream(unique("stream"), "alice", REPLICA, T0)
        await streams.open_stream(opened, limit=10_000, now=T0)
        await streams.close_streams([opened.stream_id])

    operations: list[Callable[[], Awaitable[Any]]] = [
        turn,
        stream,
        lambda: store.get_session(shared),
        lambda: store.list_messages(shared, 0, 100),
        lambda: store.events_after(shared, 0, 100),
        lambda: store.running_turns(),
        lambda: store.load_context(shared),
    ]
    callers: list[asyncio.Task[Any]] = []
    caplog.set_level(logging.WARNING)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(CALLERS):
            # ensure_future: load_context answers a kept context with a finished future.
            caller = asyncio.ensure_future(rng.choice(operations)())
            callers.append(caller)
            await yield_loop(rng.randrange(12))
            caller.cancel()
            # Again, where a caller that unwinds would be rolling back or returning its
            # connection.
            await yield_loop(rng.randrange(4))
            caller.cancel()
        results = await asyncio.gather(*callers, return_exceptions=True)
        # What a caller that left started runs to its end; then every connection is back.
        await store.units_of_work.drain(30)
        await streams.units_of_work.drain(30)
        assert checked_out(engine, hot_pool) == 0
        gc.collect()
    unexpected = [
        r
        for r in results
        if isinstance(r, BaseException)
        and not isinstance(r, asyncio.CancelledError | PlannerError | StoreConflict)
    ]
    assert unexpected == []
    assert not [w for w in caught if "garbage collector" in str(w.message)]
    assert "garbage collector" not in caplog.text
    if engine.dialect.name == "postgresql":
        async with engine.connect() as conn:
            busy = (
                await conn.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                        "AND pid <> pg_backend_pid() AND state <> 'idle'"
                    )
                )
            ).scalar_one()
        assert busy == 0


async def test_a_unit_of_work_whose_caller_left_still_commits(store: SqlSessionStore) -> None:
    session_id, turn_id = unique("s"), unique("t")
    await store.create_session(new_session(session_id))
    caller = asyncio.get_running_loop().create_task(
        store.start_turn(turn_start(session_id, turn_id))
    )
    await yield_loop(1)  # the caller hands the unit of work to the store, and waits
    caller.cancel()
    await asyncio.wait({caller})
    assert caller.cancelled()
    await store.units_of_work.drain(30)
    stored = await store.get_turn(turn_id)
    assert stored is not None and stored.state is TurnState.RUNNING
