"""Cross-replica signals over PostgreSQL LISTEN/NOTIFY (docs/spec/api-and-streams.md: events reach
streams on any replica within 1 s; ``CancelTurn`` takes effect within 1 s).

Two "replicas" are two stores with different replica ids on one database; the notifier
listens for one of them. Waits are on events and queues with a timeout, never sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from service.adapters.bus import NullNotifier, PgNotifier
from service.adapters.store import SqlSessionStore, make_engine, migrate
from service.core.errors import FailedPrecondition, StoreUnavailable
from service.core.ports import TurnCommit
from tests.integration.store_support import T0, new_session, tool_round_events, turn_start
from tests.pg import PgCluster

#: docs/spec/api-and-streams.md: events reach other replicas within 1 s of their commit.
DELIVERY_S = 1.0
#: A restarted cluster comes back in about a second; the notifier's backoff is capped.
RECOVERY_S = 30.0

Signal = tuple[str, str, int] | tuple[str, str]


class Received:
    """What a notifier delivered, in order, as ``("events", session, seq)`` or
    ``("cancel", turn)``, plus an event set on each resync."""

    def __init__(self) -> None:
        self.signals: asyncio.Queue[Signal] = asyncio.Queue()
        self.resynced = asyncio.Event()

    def on_events(self, session_id: str, last_sequence: int) -> None:
        self.signals.put_nowait(("events", session_id, last_sequence))

    async def on_cancel(self, turn_id: str) -> None:
        self.signals.put_nowait(("cancel", turn_id))

    def on_resync(self) -> None:
        self.resynced.set()

    async def next(self) -> Signal:
        return await asyncio.wait_for(self.signals.get(), DELIVERY_S)


@pytest.fixture
async def pg_engine(pg_url: str) -> AsyncIterator[AsyncEngine]:
    await migrate(pg_url)
    engine = make_engine(pg_url)
    try:
        yield engine
    finally:
        await engine.dispose()


@pytest.mark.postgres
async def test_signals_of_other_replicas_arrive(pg_url: str, pg_engine: AsyncEngine) -> None:
    here = SqlSessionStore(pg_engine, "replica-a")
    there = SqlSessionStore(pg_engine, "replica-b")
    received = Received()
    notifier = PgNotifier(pg_url, "replica-a")
    await notifier.start(received.on_events, received.on_cancel, received.on_resync)
    try:
        assert notifier.listening
        await here.create_session(new_session("s1"))
        # Our own events (sequences 1-2) are skipped; notifications arrive in commit
        # order, so the next one delivered proves it.
        await here.start_turn(turn_start("s1", "t1", owner="replica-a"))
        await there.commit(TurnCommit("s1", "t1", T0, events=tool_round_events("s1", "t1")))
        assert await received.next() == ("events", "s1", 5)

        await there.request_cancel("t1")
        assert await received.next() == ("cancel", "t1")
        # A cancel sent by this replica is delivered too: the owner may be anywhere.
        await here.request_cancel("t1")
        assert await received.next() == ("cancel", "t1")

        await there.delete_session("s1")
        deleted = {await received.next(), await received.next()}
        assert deleted == {("events", "s1", -1), ("cancel", "t1")}
        assert not received.resynced.is_set()
    finally:
        await notifier.stop()
    assert not notifier.listening


@pytest.mark.postgres
async def test_nothing_is_sent_for_a_refused_or_empty_write(
    pg_url: str, pg_engine: AsyncEngine
) -> None:
    there = SqlSessionStore(pg_engine, "replica-b")
    received = Received()
    notifier = PgNotifier(pg_url, "replica-a")
    await notifier.start(received.on_events, received.on_cancel)
    try:
        await there.create_session(new_session("s1"))
        await there.start_turn(turn_start("s1", "t1", owner="replica-b"))
        assert await received.next() == ("events", "s1", 2)
        # A refused start rolls back its UPDATE, and with it the notification.
        with pytest.raises(FailedPrecondition):
            await there.start_turn(turn_start("s1", "t2"))
        await there.commit(TurnCommit("s1", "t1", T0, events=tool_round_events("s1", "t1")))
        assert await received.next() == ("events", "s1", 5)
    finally:
        await notifier.stop()


@pytest.mark.postgres
@pytest.mark.slow
async def test_notifier_and_store_survive_a_database_restart(own_pg_cluster: PgCluster) -> None:
    own_pg_cluster.create_database("planner")
    url = own_pg_cluster.url("planner")
    await migrate(url)
    engine = make_engine(url)
    store = SqlSessionStore(engine, "replica-b")
    received = Received()
    notifier = PgNotifier(url, "replica-a", max_backoff_s=0.5)
    late = Received()
    late_notifier = PgNotifier(url, "replica-c", max_backoff_s=0.5)
    await notifier.start(received.on_events, received.on_cancel, received.on_resync)
    try:
        await store.create_session(new_session("s1"))
        await asyncio.to_thread(own_pg_cluster.stop)
        with pytest.raises(StoreUnavailable):
            await store.ping()
        with pytest.raises(StoreUnavailable):
            await store.start_turn(turn_start("s1", "t1"))
        # Started while the database is down: it returns, and keeps trying.
        await late_notifier.start(late.on_events, late.on_cancel, late.on_resync)
        assert not late_notifier.listening

        await asyncio.to_thread(own_pg_cluster.start)

        await asyncio.wait_for(received.resynced.wait(), RECOVERY_S)
        await asyncio.wait_for(late.resynced.wait(), RECOVERY_S)
        await store.ping()
        await store.start_turn(turn_start("s1", "t1", owner="replica-b"))
        assert await received.next() == ("events", "s1", 2)
        assert await late.next() == ("events", "s1", 2)
    finally:
        await notifier.stop()
        await late_notifier.stop()
        await engine.dispose()


async def test_null_notifier_delivers_nothing() -> None:
    received = Received()
    notifier = NullNotifier()
    await notifier.start(received.on_events, received.on_cancel, received.on_resync)
    await notifier.stop()
    assert received.signals.empty()
