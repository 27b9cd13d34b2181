"""Reads whose callers left give their connections back (decision 0180's units of work,
with the exception for reads).

Twenty transcript reads wait behind a table lock another connection holds, on a hot
path of twenty connections; their callers are cancelled (what a cancelled RPC does to
its handler). Each read is cancelled on the server ``abandoned_read_grace_s`` after its
caller left, so while the lock is still held another read gets a connection and
succeeds, and nothing of the planner waits on the lock any more.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import psycopg
import pytest
from psycopg import pq

from service.adapters.store import migrate
from service.adapters.store.database import Database, open_database
from tests.integration.store_support import REPLICA, new_session, unique

pytestmark = pytest.mark.postgres

HOT_POOL = 20
READS = 20
GRACE_S = 0.5
#: Longer than the test's bounds: a read that waited for a pooled connection this long
#: would fail, not succeed.
POOL_TIMEOUT_S = 60.0


@pytest.fixture
async def database(pg_url: str) -> AsyncIterator[Database]:
    await migrate(pg_url)
    opened = await open_database(
        pg_url,
        replica_id=REPLICA,
        hot_pool_size=HOT_POOL,
        pool_timeout_s=POOL_TIMEOUT_S,
        abandoned_read_grace_s=GRACE_S,
    )
    try:
        yield opened
    finally:
        await opened.close(timeout_s=5)


async def waiting_on_locks(admin: psycopg.AsyncConnection[tuple[object, ...]]) -> int:
    cursor = await admin.execute(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE application_name = 'ballet-planner' AND wait_event_type = 'Lock'"
    )
    row = await cursor.fetchone()
    return int(row[0]) if row else 0


async def wait_waiting(
    admin: psycopg.AsyncConnection[tuple[object, ...]], count: int, limit_s: float
) -> None:
    """Poll (bounded: the server has no event for it) until ``count`` of the planner's
    connections wait on a lock."""
    async with asyncio.timeout(limit_s):
        while await waiting_on_locks(admin) != count:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def test_cancelled_reads_behind_a_lock_do_not_hold_the_hot_pool(
    database: Database, pg_url: str
) -> None:
    store = database.sessions
    session_id = unique("s")
    await store.create_session(new_session(session_id))
    libpq = pg_url.replace("postgresql+psycopg://", "postgresql://")
    async with (
        await psycopg.AsyncConnection.connect(libpq, autocommit=True) as admin,
        await psycopg.AsyncConnection.connect(libpq) as locker,
    ):
        # A migration, a VACUUM FULL, an operator's transaction: the transcript is locked.
        await locker.execute("LOCK TABLE messages IN ACCESS EXCLUSIVE MODE")
        callers = [asyncio.ensure_future(store.load_context(session_id)) for _ in range(READS)]
        await wait_waiting(admin, READS, limit_s=20)
        for caller in callers:
            caller.cancel()
        await asyncio.gather(*callers, return_exceptions=True)

        # Within the grace and a cancel's round trip, the hot path has connections again.
        async with asyncio.timeout(10):
            session = await store.get_session(session_id)
        assert session is not None and session.session_id == session_id
        await wait_waiting(admin, 0, limit_s=10)
        assert locker.info.transaction_status == pq.TransactionStatus.INTRANS, "lock released"
        assert database.units_of_work.abandoned_reads_cancelled == READS
        await locker.rollback()
    assert database.units_of_work.in_flight == 0
    assert database.checked_out() == 0
