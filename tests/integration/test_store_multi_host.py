"""A database URL naming several hosts, the first of them dead, works for every
connection the planner opens: the migration, the SQLAlchemy pool, the hot path's pool
and the LISTEN connection (each tries the hosts in order and keeps the writable one)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from sqlalchemy.engine import make_url

from service.adapters.bus import PgNotifier
from service.adapters.store import migrate
from service.adapters.store.database import open_database
from service.adapters.store.engine import conninfo
from tests.integration.store_support import REPLICA, new_session, unique
from tests.ports import refused_port

pytestmark = pytest.mark.postgres


def multi_host(url: str, dead_port: int) -> str:
    parsed = make_url(url)
    live = f"{parsed.host or '127.0.0.1'}:{parsed.port or 5432}"
    query = {"host": [f"127.0.0.1:{dead_port}", live], "target_session_attrs": "read-write"}
    return parsed.set(host=None, port=None, query=query).render_as_string(hide_password=False)


def test_conninfo_names_every_host_in_order() -> None:
    url = "postgresql+psycopg://planner:pw@/db?host=a:5432&host=b:6432&target_session_attrs=read-write"
    info = dict(part.split("=", 1) for part in conninfo(url).split())
    assert info["host"] == "a,b"
    assert info["port"] == "5432,6432"
    assert info["target_session_attrs"] == "read-write"
    assert (info["dbname"], info["user"], info["password"]) == ("db", "planner", "pw")


@pytest.fixture
def dead_port() -> Iterator[int]:
    """A port where nothing listens, held for the test (a host that is down)."""
    with refused_port() as port:
        yield port


async def test_every_connection_finds_the_live_host(pg_url: str, dead_port: int) -> None:
    url = multi_host(pg_url, dead_port)
    await migrate(url)
    database = await open_database(url, replica_id=REPLICA, connect_timeout_s=2)
    notifier = PgNotifier(url, REPLICA, connect_timeout_s=2)
    try:
        session_id = unique("s")
        await database.sessions.create_session(new_session(session_id))  # SQLAlchemy
        session = await database.sessions.get_session(session_id)  # the hot path
        assert session is not None
        await database.sessions.ping()  # both pools
        await notifier.start(lambda *_: None, lambda *_: None)
        assert notifier.listening
    finally:
        await notifier.stop()
        await asyncio.wait_for(database.close(), 10)
