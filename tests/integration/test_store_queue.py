"""The ``SessionStore`` contract for queued turns (decision 0300), on every store
(``conftest.session_store``: PostgreSQL with and without the hot path, SQLite, memory).

A message sent with ``on_busy`` while a turn runs is a QUEUED turn stored before it is
acknowledged; the transaction that ends a turn starts the first queued one (INTERRUPT
first, then acceptance order) with the ending replica as owner, and its human message is
stored where it starts.
"""

from __future__ import annotations

import dataclasses

import pytest

from service.core.errors import InvalidArgument, ResourceExhausted, StoreConflict
from service.core.model import (
    EventKind,
    MessageKind,
    MessageQueuedData,
    OnBusy,
    SessionEvent,
    TurnEndedData,
    TurnEndReason,
    TurnState,
    Usage,
)
from service.core.ports import SessionStore, StartOutcomeKind
from tests.integration.store_support import (
    LEASE,
    REPLICA,
    T0,
    end_commit,
    new_session,
    promotion,
    queued_start,
    turn_start,
)


@pytest.fixture
def store(session_store: SessionStore) -> SessionStore:
    """The store under contract: each SQL database, and memory."""
    return session_store


def cancelled(session_id: str, turn_id: str) -> SessionEvent:
    """The ``turn_ended`` of a queued turn cancelled before it ran."""
    data = TurnEndedData(TurnEndReason.CANCELLED, Usage(), Usage(), 0)
    return SessionEvent(session_id, turn_id, EventKind.TURN_ENDED, T0, data=data)


async def running(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))
    outcome = await store.start_turn(turn_start("s1", "t1"))
    assert outcome.kind is StartOutcomeKind.STARTED


async def test_a_message_queues_behind_the_running_turn(store: SessionStore) -> None:
    await running(store)

    outcome = await store.start_turn(queued_start("s1", "q1", text="also T-7"))

    assert outcome.kind is StartOutcomeKind.QUEUED
    assert outcome.turn.state is TurnState.QUEUED
    assert outcome.turn.behind_turn_id == "t1"
    (event,) = outcome.events
    assert event.kind is EventKind.MESSAGE_QUEUED and event.sequence == 3
    assert event.data == MessageQueuedData("also T-7", "t1", OnBusy.ENQUEUE, "alice")
    stored = await store.get_turn("q1")
    assert stored is not None and stored.state is TurnState.QUEUED
    assert stored.queued_text == "also T-7" and stored.human_sequence == 3
    # The transcript holds the message only once its turn starts.
    assert [m.text for m in await store.list_messages("s1", 0, 10)] == ["What is runnable?"]
    session = await store.get_session("s1")
    assert session is not None and session.running_turn_id == "t1"
    assert session.last_sequence == 3
    assert await store.events_after("s1", 2, 10) == [event]


async def test_without_a_running_turn_a_queued_send_starts_at_once(store: SessionStore) -> None:
    await store.create_session(new_session("s1"))

    outcome = await store.start_turn(queued_start("s1", "q1"))

    assert outcome.kind is StartOutcomeKind.STARTED
    assert outcome.turn.state is TurnState.RUNNING


async def test_the_ending_starts_the_queued_turns_in_acceptance_order(
    store: SessionStore,
) -> None:
    await running(store)
    await store.start_turn(queued_start("s1", "q1", text="first", token="tok-1"))
    second = await store.start_turn(queued_start("s1", "q2", text="second"))
    assert second.turn.behind_turn_id == "q1"

    end = await store.end_turn(end_commit("s1", "t1"), promotion("replica-b"))

    assert [e.sequence for e in end.events] == [5]
    promoted = end.promoted
    assert promoted is not None
    assert promoted.token == "tok-1"
    assert promoted.turn.turn_id == "q1" and promoted.turn.state is TurnState.RUNNING
    assert promoted.turn.owner == "replica-b" and promoted.turn.human_sequence == 6
    assert promoted.turn.lease_expires_at == T0 + LEASE
    assert [(e.kind, e.sequence) for e in promoted.events] == [
        (EventKind.MESSAGE_ACCEPTED, 6),
        (EventKind.TURN_STARTED, 7),
    ]
    assert await store.events_after("s1", 4, 10) == [*end.events, *promoted.events]
    transcript = await store.list_messages("s1", 0, 10)
    assert [(m.kind, m.text, m.sequence) for m in transcript] == [
        (MessageKind.HUMAN, "What is runnable?", 1),
        (MessageKind.HUMAN, "first", 6),
    ]
    stored = await store.get_turn("q1")
    assert stored is not None
    assert (stored.state, stored.owner, stored.human_sequence) == (
        TurnState.RUNNING,
        "replica-b",
        6,
    )
    assert stored.queued_text == ""
    session = await store.get_session("s1")
    assert session is not None and session.running_turn_id == "q1"
    assert session.last_sequence == 7
    snapshot = await store.load_context("s1")
    assert snapshot is not None and [m.text for m in snapshot.messages][-1] == "first"

    end = await store.end_turn(end_commit("s1", "q1", owner="replica-b"), promotion(REPLICA))
    assert end.promoted is not None and end.promoted.turn.turn_id == "q2"
    end = await store.end_turn(end_commit("s1", "q2"), promotion(REPLICA))
    assert end.promoted is None
    session = await store.get_session("s1")
    assert session is not None and session.running_turn_id == ""


async def test_an_interrupt_goes_first_and_flags_the_running_turn(store: SessionStore) -> None:
    await running(store)
    await store.start_turn(queued_start("s1", "q1"))

    outcome = await store.start_turn(queued_start("s1", "i1", on_busy=OnBusy.INTERRUPT))

    assert outcome.kind is StartOutcomeKind.QUEUED
    assert outcome.turn.behind_turn_id == "t1"
    assert outcome.interrupted is not None and outcome.interrupted.turn_id == "t1"
    flagged = await store.get_turn("t1")
    assert flagged is not None and flagged.cancel_requested
    assert flagged.cancel_reason == "interrupted_by_message"
    lease = await store.renew_lease("t1", REPLICA, T0 + LEASE)
    assert lease.cancel_requested and lease.cancel_reason == "interrupted_by_message"
    ending = end_commit("s1", "t1", TurnEndReason.INTERRUPTED_BY_MESSAGE)
    end = await store.end_turn(ending, promotion())
    assert end.promoted is not None and end.promoted.turn.turn_id == "i1"


async def test_the_queue_is_bounded_and_a_refusal_stores_nothing(store: SessionStore) -> None:
    await running(store)
    await store.start_turn(queued_start("s1", "q1", max_queued=2))
    await store.start_turn(queued_start("s1", "q2", max_queued=2))

    with pytest.raises(ResourceExhausted) as refused:
        await store.start_turn(queued_start("s1", "q3", max_queued=2))

    assert refused.value.reason == "QUEUE_FULL"
    assert await store.get_turn("q3") is None
    session = await store.get_session("s1")
    assert session is not None and session.last_sequence == 4


async def test_a_resent_queued_message_is_never_queued_twice(store: SessionStore) -> None:
    await running(store)
    first = await store.start_turn(queued_start("s1", "q1"))

    again = await store.start_turn(dataclasses.replace(queued_start("s1", "q1-again")))
    resent = queued_start("s1", "q1")

    duplicate = await store.start_turn(resent)
    assert again.kind is StartOutcomeKind.QUEUED  # another request id queues
    assert duplicate.kind is StartOutcomeKind.DUPLICATE
    assert duplicate.turn.turn_id == "q1"
    assert list(duplicate.events) == list(first.events)
    with pytest.raises(InvalidArgument) as reused:
        await store.start_turn(queued_start("s1", "q1", request_hash="another"))
    assert reused.value.reason == "REQUEST_ID_REUSED"

    # Once it started, a resend answers with the message_accepted where it started.
    end = await store.end_turn(end_commit("s1", "t1"), promotion())
    assert end.promoted is not None
    duplicate = await store.start_turn(queued_start("s1", "q1"))
    assert duplicate.kind is StartOutcomeKind.DUPLICATE
    assert list(duplicate.events) == end.promoted.events[:1]


async def test_a_cancelled_queued_turn_ends_without_running(store: SessionStore) -> None:
    await running(store)
    await store.start_turn(queued_start("s1", "q1"))
    await store.start_turn(queued_start("s1", "q2"))

    (ended,) = await store.cancel_queued("q1", cancelled("s1", "q1"))

    assert ended.sequence == 5
    turn = await store.get_turn("q1")
    assert turn is not None
    assert (turn.state, turn.end_reason) == (TurnState.ENDED, TurnEndReason.CANCELLED)
    assert await store.cancel_queued("q1", cancelled("s1", "q1")) == []
    assert await store.cancel_queued("t1", cancelled("s1", "t1")) == []
    end = await store.end_turn(end_commit("s1", "t1"), promotion())
    assert end.promoted is not None and end.promoted.turn.turn_id == "q2"
    texts = [m.text for m in await store.list_messages("s1", 0, 10)]
    assert texts == ["What is runnable?", "and then q2?"]


async def test_a_sweeper_ending_starts_the_queued_turn_on_its_replica(
    store: SessionStore,
) -> None:
    await running(store)
    await store.start_turn(queued_start("s1", "q1"))
    later = T0 + 2 * LEASE
    ending = dataclasses.replace(
        end_commit("s1", "t1", TurnEndReason.INTERRUPTED), owner=None, lease_expired_before=later
    )

    end = await store.end_turn(ending, promotion("replica-b", now=later))

    assert end.promoted is not None
    assert end.promoted.turn.owner == "replica-b"
    assert end.promoted.turn.lease_expires_at == later + LEASE


async def test_join_messages_join_the_running_turn_in_order(store: SessionStore) -> None:
    await running(store)
    await store.start_turn(queued_start("s1", "j1", on_busy=OnBusy.JOIN, text="also A"))
    await store.start_turn(queued_start("s1", "q1"))
    outcome = await store.start_turn(queued_start("s1", "j2", on_busy=OnBusy.JOIN, text="and B"))
    assert outcome.join_into is not None and outcome.join_into.turn_id == "t1"
    pending = await store.get_turn("t1")
    assert pending is not None and pending.join_pending
    lease = await store.renew_lease("t1", REPLICA, T0 + LEASE)
    assert lease.join_pending and not lease.cancel_requested

    joined = await store.join_queued("s1", "t1", REPLICA, T0)

    assert [(e.kind, e.turn_id) for e in joined] == [
        (EventKind.MESSAGE_ACCEPTED, "t1"),
        (EventKind.TURN_ENDED, "j1"),
        (EventKind.MESSAGE_ACCEPTED, "t1"),
        (EventKind.TURN_ENDED, "j2"),
    ]
    assert [e.sequence for e in joined] == [6, 7, 8, 9]
    texts = [(m.turn_id, m.text) for m in await store.list_messages("s1", 0, 10)]
    assert texts == [("t1", "What is runnable?"), ("t1", "also A"), ("t1", "and B")]
    for turn_id in ("j1", "j2"):
        ended = await store.get_turn(turn_id)
        assert ended is not None and ended.end_reason is TurnEndReason.JOINED
    after = await store.get_turn("t1")
    assert after is not None and not after.join_pending
    assert await store.join_queued("s1", "t1", REPLICA, T0) == []
    end = await store.end_turn(end_commit("s1", "t1"), promotion())
    assert end.promoted is not None and end.promoted.turn.turn_id == "q1"


async def test_a_join_that_came_too_late_runs_as_its_own_turn(store: SessionStore) -> None:
    await running(store)
    await store.start_turn(queued_start("s1", "j1", on_busy=OnBusy.JOIN, text="also A"))

    end = await store.end_turn(end_commit("s1", "t1"), promotion())

    assert end.promoted is not None and end.promoted.turn.turn_id == "j1"
    with pytest.raises(StoreConflict):
        await store.join_queued("s1", "t1", REPLICA, T0)
