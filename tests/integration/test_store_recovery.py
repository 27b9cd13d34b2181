"""Back at once when the database is (decision 0312).

The hot path's psycopg pool reconnects on its own backoff (1, 2, 4, 8, 16 s between
tries). PostgreSQL stops long enough for that backoff to grow, then starts again: every
unit of work right after (a ping, a session read, several in a row, and a stream store's
unit on the same pool, which met no outage itself: decision 0370) succeeds at once on
a connection of its own, without waiting for the pool's next try.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from service.adapters.store import migrate
from service.adapters.store.database import open_database
from service.core.errors import StoreUnavailable
from service.core.ports import OpenStream
from tests.integration.store_support import REPLICA, T0, new_session, unique
from tests.pg import PgCluster

pytestmark = pytest.mark.postgres

#: Long enough for the pool to be waiting several seconds before its next try.
OUTAGE_S = 8.0


@pytest.fixture
def cluster() -> Iterator[PgCluster]:
    cluster = PgCluster.temporary()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.destroy()


async def test_units_of_work_succeed_at_once_when_the_database_returns(
    cluster: PgCluster,
) -> None:
    url = cluster.url("postgres")
    await migrate(url)
    database = await open_database(url, replica_id=REPLICA, unit_timeout_s=5)
    try:
        store, streams = database.sessions, database.streams
        session_id = unique("s")
        await store.create_session(new_session(session_id))
        await streams.heartbeat(REPLICA, T0 + timedelta(days=3650))
        cluster.stop("fast")
        with pytest.raises(StoreUnavailable):
            await store.get_session(session_id)
        # The outage lasts; the pool backs off meanwhile.
        await asyncio.sleep(OUTAGE_S)
        with pytest.raises(StoreUnavailable):
            await store.ping()
        cluster.start()
        back = time.monotonic()
        await store.ping()
        for _ in range(5):
            assert await store.get_session(session_id) is not None
        # The stream store shares the pool but met no outage itself: it goes direct too
        # (it waited its whole deadline on the pool, whose growth waited on its backoff;
        # decision 0370).
        stream = OpenStream(unique("stream"), "alice", REPLICA, T0)
        assert await streams.open_stream(stream, limit=16, now=T0)
        await streams.close_streams([stream.stream_id])
        took = time.monotonic() - back
        # The pool's next try is seconds away: only a unit that connects on its own is
        # this quick.
        assert took < 1.0, f"{took:.2f} s after the database returned"
    finally:
        await database.close(timeout_s=5)
