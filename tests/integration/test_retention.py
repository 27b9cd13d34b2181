"""Retention and erasure on a real database (PostgreSQL and SQLite): each deletes what it
says, with everything stored under it, and nothing else (docs/retention.md; decisions
0250-0252).

Sessions are planted through the store with the tests' fixed clock (``T0``); the purge
runs ``NOW`` = 100 days later with 30 idle days, so its cutoff is ``T0`` + 70 days. Every
test compares what is left, table by table, with what was there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime, timedelta

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.adapters.bus import PgNotifier
from service.adapters.store import SqlSessionStore, make_engine, migrate
from service.adapters.store.retention import SqlRetentionStore
from service.adapters.store.streams import SqlStreamStore
from service.adapters.store.tables import (
    chat_streams,
    messages,
    session_events,
    sessions,
    turns,
)
from service.core.errors import StoreUnavailable
from service.core.model import EventKind, MessageKind, SessionEvent, TurnEndReason
from service.core.ports import OpenStream, TurnCommit
from service.core.retention import (
    Deleted,
    LockCheck,
    PassOutcome,
    PurgeBounds,
    PurgeObserver,
    Purger,
    PurgeReason,
    Window,
)
from service.server.metrics import Metrics
from service.server.retention import PrometheusPurgeObserver
from tests.integration.store_support import (
    REPLICA,
    T0,
    end_commit,
    message,
    new_session,
    tool_round_events,
    turn_start,
)

NOW = T0 + timedelta(days=100)
IDLE_DAYS = 30
CUTOFF = NOW - timedelta(days=IDLE_DAYS)
#: No pause between batches: the tests wait for nothing.
FAST = PurgeBounds(max_sessions=100, max_events=10_000, pause_s=0)
TABLES = {"sessions": sessions, "messages": messages, "events": session_events, "turns": turns}


class FixedClock:
    """The purge's clock: wall time ``NOW``; a real monotonic clock for its waits."""

    def now(self) -> datetime:
        return NOW

    def monotonic(self) -> float:
        return time.monotonic()


class Observer:
    def __init__(self) -> None:
        self.calls: list[tuple[PurgeReason, int, int]] = []

    def deleted(self, reason: PurgeReason, sessions: int, messages: int) -> None:
        self.calls.append((reason, sessions, messages))

    def pass_ended(self, outcome: PassOutcome, at: datetime) -> None:
        pass


# --------------------------------------------------------------------------- planting


def answer(session_id: str, turn_id: str, human: str, at: datetime) -> SessionEvent:
    return SessionEvent(
        session_id,
        turn_id,
        EventKind.ASSISTANT_MESSAGE,
        at,
        message=message(
            session_id, turn_id, MessageKind.ASSISTANT, text="Done.", human_id=human, now=at
        ),
    )


async def plant(
    store: SqlSessionStore,
    session_id: str,
    *,
    owner: str = "alice",
    at: datetime = T0,
    turns: int = 1,
    tool_rounds: int = 0,
    running: bool = False,
    request_id: str = "",
) -> None:
    """A session of ``owner`` created at ``at`` with ``turns`` ended turns (each a human
    message, ``tool_rounds`` tool rounds and an answer, all at ``at``); with ``running``
    the last turn is left running."""
    await store.create_session(
        new_session(session_id, owner=owner, now=at, request_id=request_id, request_hash="h")
    )
    for index in range(turns):
        turn_id = f"{session_id}-t{index}"
        await store.start_turn(turn_start(session_id, turn_id, human=owner, now=at))
        for _ in range(tool_rounds):
            events = tool_round_events(session_id, turn_id, now=at)
            await store.commit(TurnCommit(session_id, turn_id, at, events=events))
        if running and index == turns - 1:
            return
        last = [answer(session_id, turn_id, owner, at)]
        await store.commit(end_commit(session_id, turn_id, now=at, events=last))


async def counts(engine: AsyncEngine, session_ids: Sequence[str]) -> dict[str, int]:
    """Rows of ``session_ids`` in each table."""
    found: dict[str, int] = {}
    async with engine.connect() as conn:
        for name, table in TABLES.items():
            query = select(func.count()).where(table.c.session_id.in_(session_ids))
            found[name] = int((await conn.execute(query)).scalar_one())
    return found


async def session_ids(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as conn:
        return {str(v) for v in (await conn.execute(select(sessions.c.session_id))).scalars()}


def purger(
    engine: AsyncEngine,
    store: SqlSessionStore,
    *,
    on_deleted: Callable[[Sequence[str]], None] = lambda ids: None,
    observer: PurgeObserver | None = None,
) -> Purger:
    return Purger(
        SqlRetentionStore(engine, "purger"),
        store,
        FixedClock(),
        FAST,
        on_deleted=on_deleted,
        observer=observer,
    )


# --------------------------------------------------------------------------- idle


async def test_an_idle_pass_deletes_idle_sessions_with_everything_and_nothing_else(
    engine: AsyncEngine, store: SqlSessionStore
) -> None:
    # Idle: no activity since T0, whoever owns them.
    await plant(store, "old-alice", turns=2, tool_rounds=1, request_id="create-1")
    await plant(store, "old-bob", owner="bob")
    await plant(store, "old-empty", turns=0)
    # Not idle: a recent event, a recent rename, a recent creation, a running turn.
    await plant(store, "recent-turn", at=T0)
    await plant_later_turn(store, "recent-turn", at=NOW - timedelta(days=10))
    await plant(store, "renamed", at=T0)
    await store.update_session_title("renamed", "Still wanted", NOW - timedelta(days=1))
    await plant(store, "new", at=NOW - timedelta(days=29), turns=0)
    await plant(store, "running", at=T0, running=True)
    # A session last active exactly at the cutoff is not idle yet (strictly before).
    await plant(store, "at-cutoff", at=CUTOFF)

    idle = ["old-alice", "old-bob", "old-empty"]
    kept = ["recent-turn", "renamed", "new", "running", "at-cutoff"]
    before_idle = await counts(engine, idle)
    before_kept = await counts(engine, kept)
    assert before_idle["messages"] == 2 * (1 + 3 + 1) + 2 > 0
    deleted_ids: list[str] = []
    observer = Observer()

    report = await purger(
        engine, store, on_deleted=deleted_ids.extend, observer=observer
    ).purge_idle(IDLE_DAYS)

    assert (report.sessions, report.messages) == (3, before_idle["messages"])
    assert report.idle_before == CUTOFF and not report.skipped
    assert sorted(deleted_ids) == sorted(idle)
    assert observer.calls == [(PurgeReason.IDLE, 3, before_idle["messages"])]
    assert await counts(engine, idle) == dict.fromkeys(TABLES, 0)
    assert await counts(engine, kept) == before_kept
    assert await session_ids(engine) == set(kept)
    # The CreateSession key went with its session: the same request creates anew.
    again = await store.create_session(
        new_session("another", owner="alice", request_id="create-1", request_hash="h")
    )
    assert again.session_id == "another"


async def plant_later_turn(store: SqlSessionStore, session_id: str, *, at: datetime) -> None:
    turn_id = f"{session_id}-later"
    await store.start_turn(turn_start(session_id, turn_id, now=at))
    await store.commit(
        end_commit(session_id, turn_id, now=at, events=[answer(session_id, turn_id, "alice", at)])
    )


async def test_a_dry_run_counts_what_a_pass_deletes_and_deletes_nothing(
    engine: AsyncEngine, store: SqlSessionStore
) -> None:
    await plant(store, "old-1", tool_rounds=1)
    await plant(store, "old-2", turns=3)
    await plant(store, "recent", at=NOW)
    everything = await counts(engine, ["old-1", "old-2", "recent"])

    dry = await purger(engine, store).purge_idle(IDLE_DAYS, dry_run=True)

    assert dry.dry_run and (dry.sessions, dry.batches) == (2, 0)
    assert await counts(engine, ["old-1", "old-2", "recent"]) == everything
    done = await purger(engine, store).purge_idle(IDLE_DAYS)
    assert (done.sessions, done.messages) == (dry.sessions, dry.messages)


async def test_batches_stay_within_their_bounds_and_each_commits_on_its_own(
    engine: AsyncEngine, store: SqlSessionStore
) -> None:
    # Each one-turn session without tool rounds holds 4 events (message accepted, turn
    # started, answer, turn ended); "big" holds 3 turns, 12 events.
    for index in range(5):
        await plant(store, f"small-{index}", at=T0 + timedelta(seconds=index))
    await plant(store, "big", at=T0 + timedelta(seconds=10), turns=3)
    recording = RecordingStore(SqlRetentionStore(engine, "purger"))
    bounds = PurgeBounds(max_sessions=2, max_events=10, pause_s=0, scan=3)
    pauses: list[float] = []

    async def pause(seconds: float) -> None:
        pauses.append(seconds)

    report = await Purger(recording, store, FixedClock(), bounds, sleep=pause).purge_idle(IDLE_DAYS)

    # Windows of 3 sessions in (update_time, id) order; batches of at most 2 sessions and
    # 10 events inside each; the 12-event session alone.
    assert recording.batches == [
        ["small-0", "small-1"],
        ["small-2"],
        ["small-3", "small-4"],
        ["big"],
    ]
    assert report.sessions == 6 and report.batches == 4 and len(pauses) == 4
    assert await session_ids(engine) == set()

    # A batch that fails leaves the batches before it deleted: each is its own transaction.
    for index in range(4):
        await plant(store, f"again-{index}")
    failing = RecordingStore(SqlRetentionStore(engine, "purger"), fail_on=2)
    with pytest.raises(StoreUnavailable):
        await Purger(failing, store, FixedClock(), bounds).purge_idle(IDLE_DAYS)
    assert await session_ids(engine) == {"again-2", "again-3"}


class RecordingStore:
    """The real retention store, recording the ids of each batch it is asked to delete;
    with ``fail_on``, that batch (1-based) fails as if the database went away."""

    def __init__(self, inner: SqlRetentionStore, fail_on: int = 0) -> None:
        self._inner = inner
        self._fail_on = fail_on
        self.batches: list[list[str]] = []

    async def exclusively(self, work):  # type: ignore[no-untyped-def]
        return await self._inner.exclusively(work)

    async def idle_window(self, idle_before: datetime, after: object, limit: int) -> Window:
        return await self._inner.idle_window(idle_before, after, limit)

    async def human_window(self, human_id: str, after: object, limit: int) -> Window:
        return await self._inner.human_window(human_id, after, limit)

    async def delete_sessions(
        self,
        session_ids: Sequence[str],
        *,
        idle_before: datetime | None = None,
        owner_id: str | None = None,
    ) -> Deleted:
        self.batches.append(list(session_ids))
        if len(self.batches) == self._fail_on:
            raise StoreUnavailable("the database went away")
        return await self._inner.delete_sessions(
            session_ids, idle_before=idle_before, owner_id=owner_id
        )

    async def count_messages(self, session_ids: Sequence[str]) -> int:
        return await self._inner.count_messages(session_ids)

    async def running_turns_of(self, human_id: str) -> list[str]:
        return await self._inner.running_turns_of(human_id)

    async def count_sessions_of(self, human_id: str) -> int:
        return await self._inner.count_sessions_of(human_id)

    async def stream_slots_of(self, human_id: str, *, delete: bool) -> int:
        return await self._inner.stream_slots_of(human_id, delete=delete)


async def test_a_batch_rechecks_what_it_was_given_on_the_locked_rows(
    engine: AsyncEngine, store: SqlSessionStore
) -> None:
    """Between a window's read and its batch a session may become active or start a turn;
    the delete re-checks on the rows it locked and leaves those."""
    await plant(store, "idle")
    await plant(store, "became-active")
    await plant(store, "started-a-turn")
    retention = SqlRetentionStore(engine, "purger")
    window = await retention.idle_window(CUTOFF, None, 10)
    assert [c.session_id for c in window.candidates] == [
        "became-active",
        "idle",
        "started-a-turn",
    ]
    await plant_later_turn(store, "became-active", at=NOW)
    await store.start_turn(turn_start("started-a-turn", "late", now=T0 + timedelta(days=1)))

    deleted = await retention.delete_sessions(
        [c.session_id for c in window.candidates], idle_before=CUTOFF
    )

    assert deleted.session_ids == ("idle",)
    assert await session_ids(engine) == {"became-active", "started-a-turn"}
    # The owner condition of an erasure: another human's session is never deleted.
    assert await retention.delete_sessions(["became-active"], owner_id="bob") == Deleted()


async def test_the_metrics_count_what_was_deleted(
    engine: AsyncEngine, store: SqlSessionStore
) -> None:
    await plant(store, "old-1", tool_rounds=1)
    await plant(store, "old-2")
    await plant(store, "bob-1", owner="bob", at=NOW)
    metrics = Metrics()
    observer = PrometheusPurgeObserver(metrics)

    idle = await purger(engine, store, observer=observer).purge_idle(IDLE_DAYS)
    erased = await purger(engine, store, observer=observer).erase("bob")

    def sample(name: str, **labels: str) -> float:
        value = metrics.registry.get_sample_value(name, labels)
        assert value is not None, name
        return value

    assert sample("ballet_planner_retention_sessions_deleted_total", reason="idle") == 2
    assert sample("ballet_planner_retention_messages_deleted_total", reason="idle") == (
        idle.messages
    )
    assert idle.messages == (1 + 3 + 1) + 2
    assert sample("ballet_planner_retention_sessions_deleted_total", reason="erasure") == 1
    assert (
        sample("ballet_planner_retention_messages_deleted_total", reason="erasure")
        == (erased.messages)
        == 2
    )


# --------------------------------------------------------------------------- erasure


async def test_an_erasure_deletes_one_humans_sessions_and_stream_slots_and_nothing_else(
    engine: AsyncEngine, store: SqlSessionStore, streams: SqlStreamStore
) -> None:
    # Alice's sessions, idle or not; Bob's, idle or not.
    await plant(store, "alice-old", tool_rounds=1, request_id="alice-create")
    await plant(store, "alice-new", at=NOW, turns=2)
    await plant(store, "alice-empty", at=NOW, turns=0)
    await plant(store, "bob-old", owner="bob", request_id="alice-create")
    await plant(store, "bob-new", owner="bob", at=NOW)
    # Their open Chat streams, counted per human across replicas.
    await streams.heartbeat(REPLICA, NOW + timedelta(minutes=1))
    for stream_id, human in (("st-a1", "alice"), ("st-a2", "alice"), ("st-b1", "bob")):
        stream = OpenStream(stream_id, human, REPLICA, NOW)
        assert await streams.open_stream(stream, limit=16, now=NOW)
    alice = ["alice-old", "alice-new", "alice-empty"]
    bob = ["bob-old", "bob-new"]
    before_alice = await counts(engine, alice)
    before_bob = await counts(engine, bob)
    deleted_ids: list[str] = []

    dry = await purger(engine, store).erase("alice", dry_run=True)
    assert (dry.sessions, dry.messages, dry.stream_slots) == (3, before_alice["messages"], 2)
    assert await counts(engine, alice) == before_alice

    report = await purger(engine, store, on_deleted=deleted_ids.extend).erase("alice")

    assert report.complete and not report.dry_run
    assert (report.sessions, report.messages, report.stream_slots) == (
        dry.sessions,
        dry.messages,
        dry.stream_slots,
    )
    assert sorted(deleted_ids) == sorted(alice)
    assert await counts(engine, alice) == dict.fromkeys(TABLES, 0)
    assert await counts(engine, bob) == before_bob
    assert await streams.count_streams("alice", NOW) == 0
    assert await streams.count_streams("bob", NOW) == 1
    async with engine.connect() as conn:
        left = (await conn.execute(select(chat_streams.c.stream_id))).scalars().all()
    assert left == ["st-b1"]
    # Erasing someone with nothing stored is complete and deletes nothing.
    nobody = await purger(engine, store).erase("carol")
    assert nobody.complete and nobody.sessions == 0
    assert await counts(engine, bob) == before_bob


async def test_an_erasure_cancels_running_turns_and_deletes_their_sessions_once_ended(
    engine: AsyncEngine, store: SqlSessionStore
) -> None:
    await plant(store, "alice-running", at=NOW, running=True)
    await plant(store, "alice-done", at=NOW)
    await plant(store, "bob-running", owner="bob", at=NOW, running=True)
    # The replica running alice's turn: it ends the turn CANCELLED when the flag is set
    # (as a lease renewal that finds it does).
    owner_replica = asyncio.ensure_future(end_when_cancelled(store, "alice-running-t0"))

    report = await purger(engine, store).erase("alice", cancel_wait_s=10)

    await owner_replica
    assert report.complete and report.running_turns == 1 and report.sessions == 2
    assert await session_ids(engine) == {"bob-running"}
    bob_turn = await store.get_turn("bob-running-t0")
    assert (
        bob_turn is not None
        and not (
            await store.renew_lease("bob-running-t0", REPLICA, NOW + timedelta(minutes=1))
        ).cancel_requested
    )


async def end_when_cancelled(store: SqlSessionStore, turn_id: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = await store.renew_lease(turn_id, REPLICA, NOW + timedelta(minutes=1))
        if status.cancel_requested:
            session_id = turn_id.rsplit("-t", 1)[0]
            await store.commit(end_commit(session_id, turn_id, TurnEndReason.CANCELLED, now=NOW))
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{turn_id} was never cancelled")


async def test_an_erasure_never_deletes_a_session_whose_turn_goes_on(
    engine: AsyncEngine, store: SqlSessionStore
) -> None:
    """A turn that does not end in time (its replica ignores the cancel) keeps its session,
    and the erasure says it is incomplete; run again once it ended, it completes."""
    await plant(store, "alice-stuck", at=NOW, running=True)
    await plant(store, "alice-done", at=NOW)

    first = await purger(engine, store).erase("alice", cancel_wait_s=0.3)

    assert not first.complete and (first.sessions, first.left) == (1, 1)
    assert await session_ids(engine) == {"alice-stuck"}
    turn = await store.get_turn("alice-stuck-t0")
    assert turn is not None and turn.cancel_requested
    await store.commit(
        end_commit("alice-stuck", "alice-stuck-t0", TurnEndReason.CANCELLED, now=NOW)
    )
    second = await purger(engine, store).erase("alice", cancel_wait_s=0.3)
    assert second.complete and second.sessions == 1
    assert await session_ids(engine) == set()


# --------------------------------------------------------------------------- PostgreSQL


@pytest.fixture
async def two_planners(pg_url: str) -> AsyncIterator[tuple[AsyncEngine, AsyncEngine]]:
    """Two planners' engines on one PostgreSQL database."""
    await migrate(pg_url)
    first, second = make_engine(pg_url), make_engine(pg_url)
    try:
        yield first, second
    finally:
        await first.dispose()
        await second.dispose()


@pytest.mark.postgres
async def test_one_planner_at_a_time_runs_a_pass(
    two_planners: tuple[AsyncEngine, AsyncEngine],
) -> None:
    engine_a, engine_b = two_planners
    store_a = SqlSessionStore(engine_a, "replica-a")
    for index in range(3):
        await plant(store_a, f"old-{index}")
    a = SqlRetentionStore(engine_a, "replica-a")
    b = Purger(
        SqlRetentionStore(engine_b, "replica-b"),
        SqlSessionStore(engine_b, "replica-b"),
        FixedClock(),
        FAST,
    )
    inside = asyncio.Event()
    release = asyncio.Event()

    async def holding(held: LockCheck) -> bool:
        inside.set()
        await release.wait()
        return await held()

    holder = asyncio.ensure_future(a.exclusively(holding))
    await asyncio.wait_for(inside.wait(), 10)

    skipped = await b.purge_idle(IDLE_DAYS)

    assert skipped.skipped and skipped.sessions == 0
    assert await session_ids(engine_a) == {"old-0", "old-1", "old-2"}
    release.set()
    assert await holder is True
    done = await b.purge_idle(IDLE_DAYS)
    assert not done.skipped and done.sessions == 3


@pytest.mark.postgres
async def test_the_pass_lock_goes_with_its_connection(
    two_planners: tuple[AsyncEngine, AsyncEngine],
) -> None:
    """A planner that dies mid-pass (its connection ends) does not keep the others out,
    and a pass that lost its lock stops before its next batch."""
    engine_a, engine_b = two_planners
    a = SqlRetentionStore(engine_a, "replica-a")
    b = SqlRetentionStore(engine_b, "replica-b")
    inside = asyncio.Event()
    release = asyncio.Event()
    checks: list[bool] = []

    async def holding(held: LockCheck) -> bool:
        inside.set()
        await release.wait()
        checks.append(await held())
        return True

    holder = asyncio.ensure_future(a.exclusively(holding))
    await asyncio.wait_for(inside.wait(), 10)
    async with engine_b.connect() as conn:
        await conn.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_locks "
                "WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid()"
            )
        )
        await conn.commit()

    async def taken(held: LockCheck) -> str:
        return "b ran"

    deadline = time.monotonic() + 10
    outcome = None
    while outcome is None and time.monotonic() < deadline:
        outcome = await b.exclusively(taken)
    assert outcome == "b ran"
    release.set()
    # The holder's check says the lock is gone (a pass stops there, ``Purger``); its end
    # gives nothing back and keeps no broken connection in the pool.
    assert await holder is True
    assert checks == [False]
    assert await a.exclusively(taken) == "b ran"


@pytest.mark.postgres
async def test_other_replicas_hear_of_each_deleted_session(pg_url: str) -> None:
    """Deleted sessions are announced as ``DeleteSession`` announces one, once the
    deleting transaction committed: ``'-1 <replica_id>'`` on each session's channel,
    which a replica streaming it hands to its hub (its streams end NOT_FOUND)."""
    await migrate(pg_url)
    engine = make_engine(pg_url)
    heard: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    notifier = PgNotifier(pg_url, "replica-b")

    async def on_cancel(turn_id: str) -> None:
        pass

    await notifier.start(lambda s, n: heard.put_nowait((s, n)), on_cancel, lambda: None)
    try:
        store = SqlSessionStore(engine, "replica-a")
        await plant(store, "old-1")
        await plant(store, "old-2")
        notifier.follow("old-1")
        notifier.follow("old-2")
        # Followed: the first heal read reports both sessions as stored.
        seen: set[str] = set()
        while len(seen) < 2:
            seen.add((await asyncio.wait_for(heard.get(), 2.0))[0])
        while not heard.empty():
            heard.get_nowait()
        # Planting notified too; only deletions (-1) matter here.
        report = await Purger(
            SqlRetentionStore(engine, "replica-a"), store, FixedClock(), FAST
        ).purge_idle(IDLE_DAYS)
        assert report.sessions == 2
        got: set[tuple[str, int]] = set()
        while len(got) < 2:
            signal = await asyncio.wait_for(heard.get(), 1.0)
            if signal[1] < 0:
                got.add(signal)
        assert got == {("old-1", -1), ("old-2", -1)}
    finally:
        await notifier.stop()
        await engine.dispose()
