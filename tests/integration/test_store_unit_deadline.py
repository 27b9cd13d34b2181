"""Every unit of work has a deadline (decision 0310, ``database.unit_timeout_s``).

A write waits behind a lock another connection holds (what a silent database looks like
from inside a unit of work: no answer); it fails ``StoreUnavailable`` at its deadline, is
cancelled on the server, and is not executed when the lock goes: a caller told
"unavailable" never finds its request done later.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import psycopg
import pytest

from service.adapters.store import migrate
from service.adapters.store.database import Database, open_database
from service.adapters.store.engine import SocketBounds, connect_args
from service.core.errors import StoreUnavailable
from tests.integration.store_support import REPLICA, T0, new_session, unique

pytestmark = pytest.mark.postgres

DEADLINE_S = 0.5


@pytest.fixture
async def database(pg_url: str) -> AsyncIterator[Database]:
    await migrate(pg_url)
    opened = await open_database(pg_url, replica_id=REPLICA, unit_timeout_s=DEADLINE_S)
    try:
        yield opened
    finally:
        await opened.close(timeout_s=5)


async def test_a_write_past_its_deadline_fails_and_is_never_executed(
    database: Database, pg_url: str
) -> None:
    store = database.sessions
    session_id = unique("s")
    await store.create_session(new_session(session_id, title="before"))
    libpq = pg_url.replace("postgresql+psycopg://", "postgresql://")
    async with await psycopg.AsyncConnection.connect(libpq) as locker:
        await locker.execute("LOCK TABLE sessions IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="did not answer"):
            await store.update_session_title(session_id, "after", T0)
        waited = time.monotonic() - started
        assert DEADLINE_S <= waited < DEADLINE_S + 1.0
        # The cancelled statement leaves the server before the lock goes.
        async with asyncio.timeout(15):
            await database.units_of_work.drain(15)
        await locker.rollback()
    session = await store.get_session(session_id)
    assert session is not None and session.title == "before"
    assert database.units_of_work.units_expired == 1
    assert database.checked_out() == 0


async def test_every_connection_carries_the_socket_bounds(pg_url: str) -> None:
    """libpq takes the bounds (an older libpq would refuse ``tcp_user_timeout``), and
    the server's socket of the connection has them."""
    bounds = SocketBounds(tcp_user_timeout_s=3, keepalives_idle_s=4)
    libpq = pg_url.replace("postgresql+psycopg://", "postgresql://")
    args = connect_args(connect_timeout_s=5, application_name="bounds-check", bounds=bounds)
    async with await psycopg.AsyncConnection.connect(libpq, **args) as conn:
        assert conn.info.get_parameters()["tcp_user_timeout"] == "3000"
        assert conn.info.get_parameters()["keepalives_idle"] == "4"
