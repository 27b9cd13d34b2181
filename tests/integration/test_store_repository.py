"""The ``SessionStore`` port's contract: ``SqlSessionStore`` on PostgreSQL (with and
without the psycopg hot path) and SQLite, and the tests' in-memory store; every test runs
on each (``conftest.session_store``), except the one that reads the tables.

Tests assert on stored state read back through the store (and, for the cascade, on the
tables themselves), never on SQL.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import datetime, timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from service.adapters.store import SqlSessionStore
from service.adapters.store.tables import messages, session_events, turns
from service.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StoreConflict,
)
from service.core.estimate import message_tokens
from service.core.model import (
    ContextEstimate,
    EventKind,
    MessageKind,
    TurnEndReason,
    TurnState,
    Usage,
)
from service.core.ports import (
    RunningLimits,
    SessionCursor,
    SessionQuery,
    SessionStore,
    StartOutcomeKind,
    SummaryUpdate,
    TurnCommit,
    TurnPatch,
)
from tests.integration.store_support import (
    LEASE,
    REPLICA,
    T0,
    end_commit,
    every_other_event,
    message,
    new_session,
    queued_start,
    tool_round_events,
    turn_ended,
    turn_start,
)


@pytest.fixture
def store(session_store: SessionStore) -> SessionStore:
    """The store under contract: each SQL database, and memory."""
    return session_store


# ---------------------------------------------------------------------- sessions


async def test_ping_answers(store: SessionStore) -> None:
    await store.ping()


async def test_created_session_reads_back(store: SessionStore) -> None:
    created = await store.create_session(new_session("s1", title="Q3 planning"))

    assert await store.get_session("s1") == created
    assert created.title == "Q3 planning"
    assert created.last_sequence == 0
    assert created.running_turn_id == ""
    assert created.context == ContextEstimate(base_tokens=None, pending_tokens=0)
    assert created.create_time == T0
    assert created.create_time.utcoffset() == timedelta(0)
    assert await store.get_session("nope") is None


async def test_create_session_is_idempotent_per_owner_and_request_id(
    store: SessionStore,
) -> None:
    first = await store.create_session(
        new_session("s1", request_id="r1", request_hash="h1", title="A")
    )

    again = await store.create_session(
        new_session("s2", request_id="r1", request_hash="h1", title="A")
    )
    assert again == first

    with pytest.raises(InvalidArgument) as refused:
        await store.create_session(new_session("s3", request_id="r1", request_hash="other"))
    assert refused.value.reason == "REQUEST_ID_REUSED"
    assert await store.get_session("s3") is None

    # The key is per human, and an empty request id is no key at all.
    bob = await store.create_session(
        new_session("s4", owner="bob", request_id="r1", request_hash="h1")
    )
    assert bob.session_id == "s4"
    await store.create_session(new_session("s5"))
    await store.create_session(new_session("s6"))
    assert await store.get_session("s6") is not None


async def test_concurrent_creates_with_one_request_id_make_one_session(
    store: SessionStore,
) -> None:
    made = await asyncio.gather(
        *(
            store.create_session(new_session(f"s{i}", request_id="r1", request_hash="h1"))
            for i in range(8)
        )
    )
    assert len({session.session_id for session in made}) == 1


async def test_update_session_title(store: SessionStore) -> None:
    await store.create_session(new_session("s1", title="Old"))
    later = T0 + timedelta(minutes=5)

    updated = await store.update_session_title("s1", "New", later)

    assert updated is not None
    assert (updated.title, updated.update_time, updated.create_time) == ("New", later, T0)
    assert await store.get_session("s1") == updated
    assert await store.update_session_title("nope", "New", later) is None


async def test_list_sessions_walks_every_session_once_newest_first(
    store: SessionStore,
) -> None:
    # 250 sessions over 50 distinct times: five share each time, so ties by id matter.
    expected = []
    for i in range(250):
        session_id = f"s{i:03d}"
        expected.append((T0 + timedelta(seconds=i // 5), session_id))
        await store.create_session(new_session(session_id, now=expected[-1][0]))
    await store.create_session(new_session("other-project", project="p2"))
    await store.create_session(new_session("other-org", organization="globex"))
    expected.sort(reverse=True)

    seen: list[tuple[object, str]] = []
    cursor: SessionCursor | None = None
    pages = 0
    while True:
        page, cursor = await store.list_sessions(
            SessionQuery("p1", "acme", owner_id=None, page_size=100, after=cursor)
        )
        pages += 1
        seen.extend((session.create_time, session.session_id) for session in page)
        if cursor is None:
            break

    assert pages == 3
    assert seen == expected


async def test_list_sessions_of_one_owner(store: SessionStore) -> None:
    await store.create_session(new_session("a1", owner="alice"))
    await store.create_session(new_session("b1", owner="bob", now=T0 + timedelta(seconds=1)))

    page, cursor = await store.list_sessions(SessionQuery("p1", "acme", "bob", page_size=10))

    assert [session.session_id for session in page] == ["b1"]
    assert cursor is None


async def test_delete_session_removes_everything_of_it(store: SessionStore) -> None:
    await _two_sessions_one_deleted(store)
    assert await store.get_session("s1") is None
    assert await store.get_turn("t1") is None
    assert await store.list_messages("s1", 0, 100) == []
    assert await store.events_after("s1", 0, 100) == []
    assert await store.turn_messages("t1") == []
    assert await store.get_turn("tk") is not None
    assert await store.delete_session("s1") is False
    # The idempotency key went with the session: the same request id creates anew.
    again = await store.create_session(
        new_session("s1-again", request_id="create-1", request_hash="h")
    )
    assert again.session_id == "s1-again"


async def test_delete_session_leaves_no_row(engine: AsyncEngine) -> None:
    await _two_sessions_one_deleted(SqlSessionStore(engine, REPLICA))
    async with engine.connect() as conn:
        for table in (messages, session_events, turns):
            left = await conn.scalar(
                select(func.count()).select_from(table).where(table.c.session_id == "s1")
            )
            assert left == 0, table.name


async def _two_sessions_one_deleted(store: SessionStore) -> None:
    await store.create_session(new_session("s1", request_id="create-1", request_hash="h"))
    await store.create_session(new_session("keep"))
    await store.start_turn(turn_start("s1", "t1"))
    await store.commit(
        TurnCommit("s1", "t1", T0, events=tool_round_events("s1", "t1"), owner=REPLICA)
    )
    await store.start_turn(turn_start("keep", "tk"))
    assert await store.delete_session("s1") is True


# ---------------------------------------------------------------------- starting turns


async def test_start_turn_stores_the_message_and_opens_the_turn(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))
    start = turn_start("s1", "t1", text="What is runnable? ✓")

    outcome = await store.start_turn(start)

    assert outcome.kind is StartOutcomeKind.STARTED
    assert [e.sequence for e in outcome.events] == [1, 2]
    assert [e.kind for e in outcome.events] == [EventKind.MESSAGE_ACCEPTED, EventKind.TURN_STARTED]
    accepted = outcome.events[0]
    assert accepted.message == dataclasses.replace(start.message, sequence=1)
    assert outcome.turn == dataclasses.replace(start.turn, human_sequence=1)
    assert await store.get_turn("t1") == outcome.turn
    assert await store.events_after("s1", 0, 10) == list(outcome.events)
    assert await store.list_messages("s1", 0, 10) == [accepted.message]
    session = await store.get_session("s1")
    assert session is not None
    assert session.last_sequence == 2
    assert session.running_turn_id == "t1"
    assert session.context.pending_tokens == message_tokens(start.message)


async def test_start_turn_in_a_missing_session(store: SessionStore) -> None:
    with pytest.raises(NotFound) as refused:
        await store.start_turn(turn_start("nope", "t1"))
    assert refused.value.reason == "SESSION_NOT_FOUND"


async def test_two_concurrent_starts_one_wins(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))

    results = await asyncio.gather(
        store.start_turn(turn_start("s1", "t1")),
        store.start_turn(turn_start("s1", "t2")),
        return_exceptions=True,
    )

    started = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert [s.kind for s in started] == [StartOutcomeKind.STARTED]
    assert len(refused) == 1
    assert isinstance(refused[0], FailedPrecondition)
    assert refused[0].reason == "TURN_IN_PROGRESS"
    # The loser stored nothing: the winner's two events are all there is.
    winner = started[0].turn.turn_id
    assert [e.turn_id for e in await store.events_after("s1", 0, 10)] == [winner, winner]


async def test_a_running_turn_refuses_the_next(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))
    await store.start_turn(turn_start("s1", "t1"))

    with pytest.raises(FailedPrecondition) as refused:
        await store.start_turn(turn_start("s1", "t2", now=T0 + LEASE - timedelta(seconds=1)))

    assert refused.value.reason == "TURN_IN_PROGRESS"
    session = await store.get_session("s1")
    assert session is not None and session.last_sequence == 2


async def test_duplicate_request_id_returns_the_original(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))
    original = await store.start_turn(turn_start("s1", "t1", request_id="r1", request_hash="h1"))

    # While the turn runs: the duplicate check comes before the running-turn check.
    duplicate = await store.start_turn(
        turn_start("s1", "t2", request_id="r1", request_hash="h1", now=T0 + timedelta(seconds=1))
    )
    assert duplicate.kind is StartOutcomeKind.DUPLICATE
    assert duplicate.turn == original.turn
    assert list(duplicate.events) == [original.events[0]]

    # After it ended, too, and still nothing new is stored.
    await store.commit(end_commit("s1", "t1"))
    again = await store.start_turn(turn_start("s1", "t3", request_id="r1", request_hash="h1"))
    assert again.kind is StartOutcomeKind.DUPLICATE
    assert again.turn.turn_id == "t1"
    assert again.events[0].sequence == 1
    session = await store.get_session("s1")
    assert session is not None and session.last_sequence == 3


async def test_request_id_reused_with_another_payload(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))
    await store.start_turn(turn_start("s1", "t1", request_id="r1", request_hash="h1"))

    with pytest.raises(InvalidArgument) as refused:
        await store.start_turn(turn_start("s1", "t2", request_id="r1", request_hash="h2"))

    assert refused.value.reason == "REQUEST_ID_REUSED"
    assert await store.get_turn("t2") is None


async def test_expired_lease_then_close_then_start(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))
    await store.start_turn(turn_start("s1", "t1", owner="replica-dead"))
    later = T0 + LEASE + timedelta(seconds=1)

    expired = await store.start_turn(turn_start("s1", "t2", now=later))

    assert expired.kind is StartOutcomeKind.EXPIRED_TURN
    assert expired.turn.turn_id == "t1"
    assert await store.get_turn("t2") is None
    session = await store.get_session("s1")
    assert session is not None and session.last_sequence == 2

    # The sweeper's takeover: no owner condition, the lease must have expired.
    await store.commit(
        end_commit(
            "s1",
            "t1",
            TurnEndReason.INTERRUPTED,
            now=later,
            owner=None,
            lease_expired_before=later,
        )
    )
    started = await store.start_turn(turn_start("s1", "t2", now=later))

    assert started.kind is StartOutcomeKind.STARTED
    assert [e.sequence for e in started.events] == [4, 5]
    interrupted = await store.get_turn("t1")
    assert interrupted is not None
    assert (interrupted.state, interrupted.end_reason) == (
        TurnState.ENDED,
        TurnEndReason.INTERRUPTED,
    )


async def test_running_turn_limits(store: SessionStore) -> None:
    limits = RunningLimits(per_human=2, per_project=3)
    for i in range(4):
        await store.create_session(new_session(f"s{i}", owner="alice"))
    await store.create_session(new_session("b0", owner="bob"))
    await store.create_session(new_session("b1", owner="bob"))
    await store.start_turn(turn_start("s0", "t0", limits=limits))
    await store.start_turn(turn_start("s1", "t1", limits=limits))

    with pytest.raises(ResourceExhausted) as per_human:
        await store.start_turn(turn_start("s2", "t2", limits=limits))
    assert per_human.value.reason == "TOO_MANY_TURNS"
    assert per_human.value.retry_after_s is not None and per_human.value.retry_after_s > 0

    await store.start_turn(turn_start("b0", "tb0", human="bob", limits=limits))
    with pytest.raises(ResourceExhausted) as per_project:
        await store.start_turn(turn_start("b1", "tb1", human="bob", limits=limits))
    assert per_project.value.reason == "TOO_MANY_TURNS"

    # Turns whose lease expired do not count (docs/spec/turn-loop.md: only turns whose lease holds).
    later = T0 + LEASE + timedelta(seconds=1)
    started = await store.start_turn(turn_start("s2", "t2", limits=limits, now=later))
    assert started.kind is StartOutcomeKind.STARTED


# ---------------------------------------------------------------------- commits


async def test_commit_numbers_events_and_patches_the_turn(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))
    start = await store.start_turn(turn_start("s1", "t1"))
    round_events = tool_round_events("s1", "t1")

    stored = await store.commit(
        TurnCommit(
            "s1",
            "t1",
            T0,
            events=round_events,
            turn_patch=TurnPatch(
                rounds=1,
                usage=Usage(1200, 40),
                writes=0,
                instructions_version="v3",
                tool_schema_version="tools-2",
                skill_name="planning",
                skill_version="1.2.0",
            ),
            owner=REPLICA,
        )
    )

    assert [e.sequence for e in stored] == [3, 4, 5]
    assert [e.message.sequence for e in stored if e.message] == [3, 4, 5]
    turn = await store.get_turn("t1")
    assert turn is not None
    assert (turn.rounds, turn.usage, turn.instructions_version, turn.skill_version) == (
        1,
        Usage(1200, 40),
        "v3",
        "1.2.0",
    )
    assert turn.state is TurnState.RUNNING
    session = await store.get_session("s1")
    assert session is not None
    assert session.context.pending_tokens == sum(
        message_tokens(e.message) for e in [*start.events, *stored] if e.message
    )
    transcript = [e.message for e in [*start.events, *stored] if e.message]
    assert await store.turn_messages("t1") == transcript


async def test_ending_a_turn_frees_the_session(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))
    await store.start_turn(turn_start("s1", "t1"))
    end_time = T0 + timedelta(seconds=3)

    stored = await store.commit(end_commit("s1", "t1", TurnEndReason.MAX_ROUNDS, now=end_time))

    assert [e.kind for e in stored] == [EventKind.TURN_ENDED]
    turn = await store.get_turn("t1")
    assert turn is not None
    assert (turn.state, turn.end_reason, turn.end_time) == (
        TurnState.ENDED,
        TurnEndReason.MAX_ROUNDS,
        end_time,
    )
    session = await store.get_session("s1")
    assert session is not None and session.running_turn_id == ""
    started = await store.start_turn(turn_start("s1", "t2"))
    assert started.kind is StartOutcomeKind.STARTED


async def test_commit_conditions_refuse_and_store_nothing(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))
    await store.start_turn(turn_start("s1", "t1"))

    def round_commit(
        owner: str | None = None, lease_expired_before: datetime | None = None
    ) -> TurnCommit:
        return TurnCommit(
            "s1",
            "t1",
            T0,
            events=tool_round_events("s1", "t1"),
            turn_patch=TurnPatch(rounds=1),
            owner=owner,
            lease_expired_before=lease_expired_before,
        )

    with pytest.raises(StoreConflict):
        await store.commit(round_commit(owner="replica-b"))
    with pytest.raises(StoreConflict):
        # The lease holds until T0 + 15 s: a takeover at T0 + 1 s is refused.
        await store.commit(round_commit(lease_expired_before=T0 + timedelta(seconds=1)))
    with pytest.raises(StoreConflict):
        await store.commit(dataclasses.replace(round_commit(), turn_id="nope", events=()))

    await store.commit(end_commit("s1", "t1"))
    with pytest.raises(StoreConflict):
        await store.commit(round_commit(owner=REPLICA))
    with pytest.raises(StoreConflict):
        # Without events or patch, the condition is still checked.
        await store.commit(TurnCommit("s1", "t1", T0))

    session = await store.get_session("s1")
    assert session is not None and session.last_sequence == 3
    turn = await store.get_turn("t1")
    assert turn is not None and turn.rounds == 1


async def test_commit_refuses_events_of_another_session(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))
    await store.start_turn(turn_start("s1", "t1"))

    with pytest.raises(ValueError):
        await store.commit(TurnCommit("s1", "t1", T0, events=tool_round_events("s2", "t1")))


async def test_commit_stores_summary_and_context(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))
    await store.start_turn(turn_start("s1", "t1"))
    await store.commit(TurnCommit("s1", "t1", T0, events=tool_round_events("s1", "t1")))
    compacted = every_other_event("s1", "t1")[2]
    later = T0 + timedelta(seconds=2)

    await store.commit(
        TurnCommit(
            "s1",
            "t1",
            later,
            events=[compacted],
            summary=SummaryUpdate("Alice asked what is runnable.", up_to=4),
            context=ContextEstimate(base_tokens=300, pending_tokens=17),
            turn_patch=TurnPatch(compaction_usage=Usage(5000, 300)),
        )
    )

    snapshot = await store.load_context("s1")
    assert snapshot is not None
    session = snapshot.session
    assert (session.summary, session.summary_up_to, session.update_time) == (
        "Alice asked what is runnable.",
        4,
        later,
    )
    assert session.context == ContextEstimate(base_tokens=300, pending_tokens=17)
    # Only what follows the summary: the tool result (5) and the compaction marker (6).
    assert [m.sequence for m in snapshot.messages] == [5, 6]
    assert snapshot.messages[-1].kind is MessageKind.COMPACTION
    turn = await store.get_turn("t1")
    assert turn is not None and turn.compaction_usage == Usage(5000, 300)
    assert await store.load_context("nope") is None


async def test_twenty_concurrent_commits_get_gapless_sequences(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))
    await store.start_turn(turn_start("s1", "t1"))

    results = await asyncio.gather(
        *(
            store.commit(
                TurnCommit("s1", "t1", T0, events=tool_round_events("s1", "t1"), owner=REPLICA)
            )
            for _ in range(20)
        )
    )

    assigned = sorted(e.sequence for events in results for e in events)
    assert assigned == list(range(3, 3 + 20 * 3))
    for events in results:
        # Each commit's events are consecutive: one UPDATE reserved them together.
        assert [e.sequence for e in events] == list(
            range(events[0].sequence, events[0].sequence + 3)
        )
    replay = await store.events_after("s1", 0, 1000)
    assert [e.sequence for e in replay] == list(range(1, 63))
    session = await store.get_session("s1")
    assert session is not None and session.last_sequence == 62


# ---------------------------------------------------------------------- reading


async def test_events_after_round_trips_every_event_kind(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))
    start = await store.start_turn(turn_start("s1", "t1"))
    stored = [*start.events]
    stored += (await store.start_turn(queued_start("s1", "q1"))).events
    stored += await store.commit(
        TurnCommit("s1", "t1", T0, events=tool_round_events("s1", "t1"), owner=REPLICA)
    )
    stored += await store.commit(
        TurnCommit("s1", "t1", T0, events=every_other_event("s1", "t1"), owner=REPLICA)
    )
    failed = end_commit("s1", "t1", TurnEndReason.FAILED)
    failed_end = turn_ended("s1", "t1", TurnEndReason.FAILED, error_reason="MODEL_UNAVAILABLE")
    stored += await store.commit(dataclasses.replace(failed, events=[failed_end]))

    assert {e.kind for e in stored} == set(EventKind)
    replay = await store.events_after("s1", 0, 100)
    assert replay == stored
    assert await store.events_after("s1", 5, 3) == stored[5:8]
    assert await store.events_after("s1", len(stored), 10) == []


async def test_list_messages_pages_in_sequence_order(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))
    await store.start_turn(turn_start("s1", "t1"))
    for _ in range(3):
        await store.commit(TurnCommit("s1", "t1", T0, events=tool_round_events("s1", "t1")))

    everything = await store.list_messages("s1", 0, 100)
    # Messages share the event's sequence, so turn_started (2) leaves a hole.
    assert [m.sequence for m in everything] == [1, *range(3, 12)]
    assert await store.list_messages("s1", 3, 2) == everything[2:4]
    assert everything[1].usage == Usage(1200, 40)
    assert everything[2].usage is None


async def test_running_turns_and_leases(store: SessionStore) -> None:
    for session_id in ("s1", "s2", "s3"):
        await store.create_session(new_session(session_id))
    await store.start_turn(turn_start("s1", "t1", owner="replica-a"))
    await store.start_turn(turn_start("s2", "t2", owner="replica-b", lease=timedelta(seconds=5)))
    await store.start_turn(turn_start("s3", "t3", owner="replica-a"))
    await store.commit(end_commit("s3", "t3", owner="replica-a"))

    assert [t.turn_id for t in await store.running_turns()] == ["t1", "t2"]
    assert [t.turn_id for t in await store.running_turns(owner="replica-b")] == ["t2"]
    expired = await store.running_turns(lease_expired_before=T0 + timedelta(seconds=6))
    assert [t.turn_id for t in expired] == ["t2"]

    renewed = await store.renew_lease("t2", "replica-b", T0 + timedelta(seconds=20))
    assert renewed.held and not renewed.cancel_requested
    assert await store.running_turns(lease_expired_before=T0 + timedelta(seconds=6)) == []
    assert not (await store.renew_lease("t2", "replica-a", T0 + LEASE)).held
    assert not (await store.renew_lease("t3", "replica-a", T0 + LEASE)).held
    assert not (await store.renew_lease("nope", "replica-a", T0 + LEASE)).held


async def test_request_cancel(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))
    await store.start_turn(turn_start("s1", "t1"))

    flagged = await store.request_cancel("t1")

    assert flagged is not None and flagged.cancel_requested
    assert (await store.renew_lease("t1", REPLICA, T0 + LEASE)).cancel_requested
    await store.commit(end_commit("s1", "t1", TurnEndReason.CANCELLED))
    ended = await store.get_turn("t1")
    assert await store.request_cancel("t1") == ended
    assert await store.request_cancel("nope") is None


async def test_stored_times_are_aware_utc(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))
    await store.start_turn(turn_start("s1", "t1"))

    turn = await store.get_turn("t1")
    assert turn is not None and turn.lease_expires_at is not None
    assert turn.start_time.utcoffset() == timedelta(0)
    assert turn.lease_expires_at == T0 + LEASE
    [accepted, _] = await store.events_after("s1", 0, 10)
    assert accepted.create_time == T0
    assert accepted.message is not None and accepted.message.create_time == T0
    # A naive time is a bug: the store refuses to guess its zone.
    with pytest.raises(ValueError):
        await store.commit(TurnCommit("s1", "t1", T0.replace(tzinfo=None)))


async def test_human_message_of_another_turn_is_refused(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))
    start = turn_start("s1", "t1")
    stray = message("s1", "t9", MessageKind.HUMAN, text="hi")

    with pytest.raises(ValueError):
        await store.start_turn(dataclasses.replace(start, message=stray))


async def test_served_model_and_summary_prompt_version_round_trip(store: SessionStore) -> None:
    """Migration 0010 (decisions 0294, 0297): an answer's served model and a compaction
    marker's prompt version are stored and read back by every store."""
    await store.create_session(new_session("s1"))
    await store.start_turn(turn_start("s1", "t1"))
    answer, *rest = tool_round_events("s1", "t1")
    assert answer.message is not None
    served = dataclasses.replace(
        answer, message=dataclasses.replace(answer.message, served_model="smollm2-135m.gguf")
    )
    compacted = every_other_event("s1", "t1")[2]
    assert compacted.message is not None
    marker = dataclasses.replace(
        compacted, message=dataclasses.replace(compacted.message, prompt_version="v2")
    )
    stored = await store.commit(TurnCommit("s1", "t1", T0, events=[served, *rest, marker]))
    replay = await store.events_after("s1", 0, 100)
    assert replay[-len(stored) :] == stored
    by_kind = {e.kind: e.message for e in replay if e.message is not None}
    assert by_kind[EventKind.ASSISTANT_MESSAGE].served_model == "smollm2-135m.gguf"
    assert by_kind[EventKind.COMPACTED].prompt_version == "v2"
