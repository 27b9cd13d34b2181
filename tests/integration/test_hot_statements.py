"""A turn's three units of work on libpq's calls (``PgHotPath.call_followed``, decision
0393), on PostgreSQL: prepared once per connection, prepared again when the server no
longer knows the statement, their values read back as psycopg read them, and the
server's errors translated as everywhere else in the store.

One pooled connection, so that what one statement leaves on the connection is what the
next one meets.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from psycopg_pool import AsyncConnectionPool

from service.adapters.store import make_engine, migrate
from service.adapters.store.pg import PgSessionStore, make_pool
from service.core.errors import StoreConflict
from service.core.model import EventKind
from service.core.ports import StartOutcomeKind
from tests.integration.store_support import (
    REPLICA,
    end_commit,
    new_session,
    promotion,
    turn_start,
)

pytestmark = pytest.mark.postgres


@pytest.fixture
async def one_connection(pg_url: str) -> AsyncIterator[tuple[PgSessionStore, AsyncConnectionPool]]:
    await migrate(pg_url)
    engine = make_engine(pg_url)
    pool = make_pool(pg_url, max_size=1, timeout_s=10)
    await pool.open(wait=True)
    try:
        yield PgSessionStore(engine, pool, REPLICA), pool
    finally:
        await pool.close()
        await engine.dispose()


async def prepared_names(pool: AsyncConnectionPool) -> set[str]:
    async with pool.connection() as conn:
        cursor = await conn.execute("SELECT name FROM pg_prepared_statements")
        return {str(row[0]) for row in await cursor.fetchall()}


async def test_a_turn_prepares_its_statements_once_and_again_after_a_deallocate(
    one_connection: tuple[PgSessionStore, AsyncConnectionPool],
) -> None:
    store, pool = one_connection
    await store.create_session(new_session("s1"))
    started = await store.start_turn(turn_start("s1", "t1"))
    assert started.kind is StartOutcomeKind.STARTED
    assert [e.sequence for e in started.events] == [1, 2]
    assert "ballet_planner_start_turn" in await prepared_names(pool)

    # The server forgets every prepared statement of the connection (a DEALLOCATE ALL
    # by a pooler or an operator).
    async with pool.connection() as conn:
        await conn.execute("DEALLOCATE ALL")
    ended = await store.end_turn(end_commit("s1", "t1"), promotion())
    assert ended.events[-1].kind is EventKind.TURN_ENDED
    assert ended.events[-1].sequence == 3
    # The start's statement, prepared before on this connection, is gone: the next start
    # meets "does not exist", prepares it again and runs.
    again = await store.start_turn(turn_start("s1", "t2", request_id="r2"))
    assert again.kind is StartOutcomeKind.STARTED
    assert [e.sequence for e in again.events] == [4, 5]
    names = await prepared_names(pool)
    assert {"ballet_planner_start_turn", "ballet_planner_end_turn"} <= names


async def test_a_failed_condition_is_a_conflict_and_the_connection_goes_on(
    one_connection: tuple[PgSessionStore, AsyncConnectionPool],
) -> None:
    store, pool = one_connection
    await store.create_session(new_session("s1"))
    await store.start_turn(turn_start("s1", "t1"))
    # Not the turn's owner: the function raises BP409 in the server.
    with pytest.raises(StoreConflict):
        await store.end_turn(end_commit("s1", "t1", owner="replica-z"), promotion())
    ended = await store.end_turn(end_commit("s1", "t1"), promotion())
    assert ended.events[-1].kind is EventKind.TURN_ENDED
    stats = pool.get_stats()
    assert stats.get("pool_size", 0) == stats.get("pool_available", 0) == 1
