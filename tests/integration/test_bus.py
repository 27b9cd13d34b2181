"""Cross-replica signals over PostgreSQL LISTEN/NOTIFY, healed by sequence
(docs/spec/api-and-streams.md: events reach streams on any replica within 1 s;
``CancelTurn`` takes effect within 1 s).

Two "replicas" are two stores with different replica ids on one database; the notifier
listens for one of them, on the sessions it follows. Waits are on events and queues with
a timeout, never sleeps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.adapters.bus import NullNotifier, PgNotifier
from service.adapters.store import SqlSessionStore, make_engine, migrate
from service.adapters.store.pg import PgSessionStore, make_pool
from service.adapters.store.signals import session_channel
from service.adapters.store.streams import SqlStreamStore
from service.core.errors import FailedPrecondition, StoreUnavailable
from service.core.ports import TurnCommit
from service.server.metrics import Metrics
from tests.integration.store_support import T0, new_session, tool_round_events, turn_start
from tests.notify_stall import durable_stalling_cluster, stalled_notify
from tests.pg import PgCluster

#: docs/spec/api-and-streams.md: events reach other replicas within 1 s of their commit.
DELIVERY_S = 1.0
#: A restarted cluster comes back in about a second; the notifier's backoff is capped.
RECOVERY_S = 30.0
#: Heals so rare that they never come within a test that checks notifications alone.
NO_HEAL_S = 60.0

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

    async def next(self, within_s: float = DELIVERY_S) -> Signal:
        return await asyncio.wait_for(self.signals.get(), within_s)

    async def expect(self, wanted: Signal, within_s: float = DELIVERY_S) -> list[Signal]:
        """Wait for ``wanted``; returns what came before it."""
        before: list[Signal] = []
        deadline = time.monotonic() + within_s
        while True:
            got = await self.next(max(0.0, deadline - time.monotonic()))
            if got == wanted:
                return before
            before.append(got)

    def drain(self) -> list[Signal]:
        out: list[Signal] = []
        while not self.signals.empty():
            out.append(self.signals.get_nowait())
        return out


async def listening_to(notifier: PgNotifier, session_id: str) -> None:
    """Follow ``session_id`` and wait until the LISTEN went through."""
    notifier.follow(session_id)
    for _ in range(100):
        if session_channel(session_id) in notifier.listened:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{session_id} is not listened to")


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
    notifier = PgNotifier(pg_url, "replica-a", heal_interval_s=NO_HEAL_S)
    await notifier.start(received.on_events, received.on_cancel, received.on_resync)
    try:
        assert notifier.listening
        await here.create_session(new_session("s1"))
        await listening_to(notifier, "s1")
        # The heal read at the first follow: the session as stored.
        assert await received.next() == ("events", "s1", 0)
        # Our own events (sequences 1-2) are not even sent: no other replica follows s1
        # (decision 0340); the next one delivered proves it.
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
        assert notifier.counts["events"] >= 2
    finally:
        await notifier.stop()
    assert not notifier.listening


class Sent:
    """Counts what a store's ``Signals`` sent."""

    def __init__(self) -> None:
        self.sent = 0

    def __call__(self, outcome: str, count: int) -> None:
        if outcome == "sent":
            self.sent += count


async def follows(engine: AsyncEngine) -> set[tuple[str, str]]:
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT session_id, replica_id FROM session_follows"))
        return {(str(r[0]), str(r[1])) for r in rows}


@pytest.mark.postgres
@pytest.mark.parametrize("hot", [False, True], ids=["sqlalchemy", "hot-path"])
async def test_a_commit_signals_only_a_session_another_replica_follows(
    pg_url: str, pg_engine: AsyncEngine, hot: bool
) -> None:
    """Decision 0340: the commit reads who follows its session in its own round trip;
    nobody else following, it sends no ``pg_notify`` at all (a single replica sends none),
    and its own listener has nothing to read back."""
    pool = make_pool(pg_url, max_size=2, timeout_s=5)
    await pool.open()
    here: SqlSessionStore = (
        PgSessionStore(pg_engine, pool, "replica-a")
        if hot
        else SqlSessionStore(pg_engine, "replica-a")
    )
    assert here.signals is not None
    sent = Sent()
    here.signals.watch(sent)
    own, other = Received(), Received()
    own_notifier = PgNotifier(pg_url, "replica-a", heal_interval_s=NO_HEAL_S)
    other_notifier = PgNotifier(pg_url, "replica-b", heal_interval_s=NO_HEAL_S)
    await own_notifier.start(own.on_events, own.on_cancel)
    await other_notifier.start(other.on_events, other.on_cancel)
    try:
        await here.create_session(new_session("s1"))
        await listening_to(own_notifier, "s1")
        assert await own.next() == ("events", "s1", 0)
        assert await follows(pg_engine) == {("s1", "replica-a")}
        await here.start_turn(turn_start("s1", "t1", owner="replica-a"))
        await here.commit(TurnCommit("s1", "t1", T0, events=tool_round_events("s1", "t1")))
        await here.signals.flush(5.0)
        assert sent.sent == 0

        # Another replica follows: the next commit is signalled, to it.
        await listening_to(other_notifier, "s1")
        assert await other.next() == ("events", "s1", 5)
        assert await follows(pg_engine) == {("s1", "replica-a"), ("s1", "replica-b")}
        await here.commit(TurnCommit("s1", "t1", T0, events=tool_round_events("s1", "t1")))
        assert await other.next() == ("events", "s1", 8)
        # The listener may hear the signal before the sender has counted it.
        await here.signals.flush(5.0)
        assert sent.sent == 1

        # It stops following: its row goes, and commits are silent again.
        other_notifier.unfollow("s1")
        for _ in range(100):
            if ("s1", "replica-b") not in await follows(pg_engine):
                break
            await asyncio.sleep(0.02)
        await here.commit(TurnCommit("s1", "t1", T0, events=tool_round_events("s1", "t1")))
        await here.signals.flush(5.0)
        assert sent.sent == 1
        assert own.drain() == [] and other.drain() == []
    finally:
        await other_notifier.stop()
        await own_notifier.stop()
        await pool.close()


@pytest.mark.postgres
async def test_a_forgotten_replica_takes_its_follows_along(
    pg_url: str, pg_engine: AsyncEngine
) -> None:
    """A reconnecting notifier writes its rows afresh; a replica removed or swept leaves
    none behind (``SqlStreamStore``)."""
    streams = SqlStreamStore(pg_engine)
    notifier = PgNotifier(pg_url, "replica-b", heal_interval_s=NO_HEAL_S)
    received = Received()
    async with pg_engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO session_follows VALUES ('stale', 'replica-b'), ('x', 'replica-c')")
        )
    await notifier.start(received.on_events, received.on_cancel)
    try:
        await listening_to(notifier, "s9")
        assert await follows(pg_engine) == {("s9", "replica-b"), ("x", "replica-c")}
    finally:
        await notifier.stop()
    await streams.heartbeat("replica-b", datetime.now(UTC) + timedelta(seconds=30))
    await streams.heartbeat("replica-c", datetime.now(UTC) - timedelta(seconds=1))
    assert await streams.sweep_replicas(datetime.now(UTC)) == 1
    assert await follows(pg_engine) == {("s9", "replica-b")}
    await streams.remove_replica("replica-b")
    assert await follows(pg_engine) == set()


@pytest.mark.postgres
async def test_nothing_is_sent_for_a_refused_or_empty_write(
    pg_url: str, pg_engine: AsyncEngine
) -> None:
    there = SqlSessionStore(pg_engine, "replica-b")
    received = Received()
    notifier = PgNotifier(pg_url, "replica-a", heal_interval_s=NO_HEAL_S)
    await notifier.start(received.on_events, received.on_cancel)
    try:
        await there.create_session(new_session("s1"))
        await listening_to(notifier, "s1")
        assert await received.next() == ("events", "s1", 0)
        await there.start_turn(turn_start("s1", "t1", owner="replica-b"))
        assert await received.next() == ("events", "s1", 2)
        # A refused start stores nothing, and nothing is signalled.
        with pytest.raises(FailedPrecondition):
            await there.start_turn(turn_start("s1", "t2"))
        await there.commit(TurnCommit("s1", "t1", T0, events=tool_round_events("s1", "t1")))
        assert await received.next() == ("events", "s1", 5)
    finally:
        await notifier.stop()


@pytest.mark.postgres
async def test_a_replica_handles_only_the_sessions_it_follows(
    pg_url: str, pg_engine: AsyncEngine
) -> None:
    """Per-session channels: notifications of sessions this replica does not stream never
    reach it (counted as handled: zero), and an unfollowed session is not heard again."""
    there = SqlSessionStore(pg_engine, "replica-b")
    received = Received()
    metrics = Metrics()
    notifier = PgNotifier(pg_url, "replica-a", heal_interval_s=NO_HEAL_S)
    notifier.watch(metrics.count_notification)
    await notifier.start(received.on_events, received.on_cancel)
    try:
        for session_id in ("s1", "s2", "s3"):
            await there.create_session(new_session(session_id))
        await listening_to(notifier, "s1")
        assert await received.next() == ("events", "s1", 0)
        # Busy sessions nobody streams here, then one commit of the followed one.
        for session_id in ("s2", "s3"):
            await there.start_turn(turn_start(session_id, f"t-{session_id}", owner="b"))
            await there.commit(
                TurnCommit(
                    session_id,
                    f"t-{session_id}",
                    T0,
                    events=tool_round_events(session_id, f"t-{session_id}"),
                )
            )
        await there.start_turn(turn_start("s1", "t1", owner="b"))
        assert await received.next() == ("events", "s1", 2)
        assert notifier.counts["events"] == 1
        assert received.drain() == []
        handled = metrics.registry.get_sample_value(
            "ballet_planner_notifications_handled_total", {"kind": "events"}
        )
        assert handled == 1

        notifier.unfollow("s1")
        for _ in range(100):
            if not notifier.listened:
                break
            await asyncio.sleep(0.02)
        await there.commit(TurnCommit("s1", "t1", T0, events=tool_round_events("s1", "t1")))
        await there.request_cancel("t1")
        # Cancels go everywhere; the commit before it was not heard.
        assert await received.next() == ("cancel", "t1")
        assert notifier.counts["events"] == 1
    finally:
        await notifier.stop()


@pytest.mark.postgres
async def test_events_without_a_notification_are_healed_by_sequence(
    pg_url: str, pg_engine: AsyncEngine
) -> None:
    """A store that sends nothing (a lost notification): the follower's once-a-second
    read of the stored sequence delivers the events, and counts the heal."""
    silent = SqlSessionStore(pg_engine, "replica-b", notify=False)
    received = Received()
    notifier = PgNotifier(pg_url, "replica-a", heal_interval_s=0.2)
    await notifier.start(received.on_events, received.on_cancel)
    try:
        await silent.create_session(new_session("s1"))
        await listening_to(notifier, "s1")
        await received.expect(("events", "s1", 0))
        await silent.start_turn(turn_start("s1", "t1", owner="replica-b"))
        started = time.monotonic()
        await received.expect(("events", "s1", 2), within_s=1.0)
        assert time.monotonic() - started <= 1.0
        assert notifier.counts["healed"] == 1
        # A session deleted without a word is reported deleted.
        await silent.delete_session("s1")
        await received.expect(("events", "s1", -1), within_s=1.0)
    finally:
        await notifier.stop()


@pytest.mark.postgres
@pytest.mark.slow
async def test_a_stalled_notify_holds_neither_commits_nor_delivery() -> None:
    """A NOTIFYing commit elsewhere in the cluster waits forever (for a synchronous
    standby that does not exist) holding the notify lock, with fsync on: the store's
    commits go on at once, their signals fail within the lock timeout (counted), and a
    follower gets the events by sequence within about a second."""
    cluster = PgCluster.temporary()
    try:
        await asyncio.to_thread(durable_stalling_cluster, cluster)
        cluster.create_database("planner")
        url = cluster.url("planner")
        await migrate(url)
        engine = make_engine(url)
        pool = make_pool(url, max_size=4, timeout_s=5)
        await pool.open(wait=True)
        store = PgSessionStore(engine, pool, "replica-b")
        assert store.signals is not None
        outcomes: dict[str, int] = {}
        store.signals.watch(lambda o, n: outcomes.__setitem__(o, outcomes.get(o, 0) + n))
        received = Received()
        notifier = PgNotifier(url, "replica-a", heal_interval_s=1.0)
        await notifier.start(received.on_events, received.on_cancel)
        try:
            await store.create_session(new_session("s1"))
            await listening_to(notifier, "s1")
            await received.expect(("events", "s1", 0), within_s=2.0)
            async with stalled_notify(url):
                await stalled_turn(store, received)
            assert outcomes.get("failed", 0) >= 1, outcomes
        finally:
            await notifier.stop()
            await store.signals.close()
            await pool.close()
            await engine.dispose()
    finally:
        await asyncio.to_thread(cluster.destroy)


async def stalled_turn(store: PgSessionStore, received: Received) -> None:
    """A turn's commits while NOTIFY is stalled: at once; delivered by the heal."""
    assert store.signals is not None
    # Bounds, not measurements: a commit that waited for the notify lock would hang.
    await asyncio.wait_for(store.start_turn(turn_start("s1", "t1", owner="replica-b")), 2.0)
    await asyncio.wait_for(
        store.commit(TurnCommit("s1", "t1", T0, events=tool_round_events("s1", "t1"))), 2.0
    )
    # No notification gets through; the heal read (every 1 s) delivers.
    await received.expect(("events", "s1", 5), within_s=2.5)
    # Waiting for the lock, the signals fail within their lock timeout.
    await store.signals.flush(5.0)


@pytest.mark.postgres
@pytest.mark.slow
async def test_notifier_and_store_survive_a_database_restart(own_pg_cluster: PgCluster) -> None:
    own_pg_cluster.create_database("planner")
    url = own_pg_cluster.url("planner")
    await migrate(url)
    engine = make_engine(url)
    store = SqlSessionStore(engine, "replica-b")
    received = Received()
    notifier = PgNotifier(url, "replica-a", max_backoff_s=0.5, heal_interval_s=NO_HEAL_S)
    late = Received()
    late_notifier = PgNotifier(url, "replica-c", max_backoff_s=0.5, heal_interval_s=NO_HEAL_S)
    await notifier.start(received.on_events, received.on_cancel, received.on_resync)
    try:
        await store.create_session(new_session("s1"))
        await listening_to(notifier, "s1")
        assert await received.next() == ("events", "s1", 0)
        await asyncio.to_thread(own_pg_cluster.stop)
        with pytest.raises(StoreUnavailable):
            await store.ping()
        with pytest.raises(StoreUnavailable):
            await store.start_turn(turn_start("s1", "t1"))
        # Started while the database is down: it returns, and keeps trying.
        await late_notifier.start(late.on_events, late.on_cancel, late.on_resync)
        late_notifier.follow("s1")
        assert not late_notifier.listening

        await asyncio.to_thread(own_pg_cluster.start)

        await asyncio.wait_for(received.resynced.wait(), RECOVERY_S)
        await asyncio.wait_for(late.resynced.wait(), RECOVERY_S)
        # Listening again on what they follow, each healed once on the way.
        await received.expect(("events", "s1", 0))
        await late.expect(("events", "s1", 0))
        await store.ping()
        await store.start_turn(turn_start("s1", "t1", owner="replica-b"))
        assert await received.next() == ("events", "s1", 2)
        assert await late.next() == ("events", "s1", 2)
    finally:
        await notifier.stop()
        await late_notifier.stop()
        assert store.signals is not None
        await store.signals.close()
        await engine.dispose()


async def test_null_notifier_delivers_nothing() -> None:
    received = Received()
    notifier = NullNotifier()
    await notifier.start(received.on_events, received.on_cancel, received.on_resync)
    notifier.follow("s1")
    notifier.unfollow("s1")
    await notifier.stop()
    assert received.signals.empty()
