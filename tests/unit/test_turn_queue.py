"""Messages sent while a turn runs (decision 0300, 0301): ENQUEUE, INTERRUPT, the queue's
bound, cancelling a queued turn, resends and the sweeper, on the in-memory store.

The integration tier pins the store's side on every database
(``tests/integration/test_store_queue.py``); the replica tier runs it across two
planner processes (``tests/replicas/test_queue.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import replace
from typing import Any

import pytest

from service.core.errors import FailedPrecondition, ResourceExhausted
from service.core.model import (
    EventKind,
    MessageKind,
    MessageQueuedData,
    OnBusy,
    TurnEndReason,
    TurnState,
)
from service.core.ports import ModelRequest, Role
from service.core.turn.service import Accepted
from tests.unit.fakes import last_role
from tests.unit.test_turn import Rig, make_rig

PROPOSAL = json.dumps(
    {"title": "t", "operations": [{"create_item": {"kind": "ticket", "title": "x"}}]}
)


async def send(rig: Rig, text: str, on_busy: OnBusy, request_id: str = "") -> Accepted:
    return await rig.accept(text, request_id or f"req-{text}", on_busy)


def last_human(request: ModelRequest) -> str:
    return next(m.text for m in reversed(request.messages) if m.role is Role.USER)


def held_first_answer(release: asyncio.Event) -> Any:
    """The first turn's answer waits for ``release``; later turns answer at once."""

    def script(request: ModelRequest) -> dict[str, Any]:
        if last_human(request) == "first":
            return {"chunks": ["One"], "block": release}
        return {"text": f"answer to {last_human(request)}"}

    return script


async def test_enqueued_messages_run_in_order_after_the_running_turn() -> None:
    release = asyncio.Event()
    rig = make_rig(held_first_answer(release))
    first = await send(rig, "first", OnBusy.REJECT)
    await rig.gateway.started.wait()

    second = await send(rig, "second", OnBusy.ENQUEUE)
    third = await send(rig, "third", OnBusy.ENQUEUE)

    assert second.queued and third.queued and not first.queued
    assert second.turn.state is TurnState.QUEUED
    assert (second.turn.behind_turn_id, third.turn.behind_turn_id) == (
        first.turn.turn_id,
        second.turn.turn_id,
    )
    data = second.message_accepted.data
    assert isinstance(data, MessageQueuedData) and data.on_busy is OnBusy.ENQUEUE
    assert len(rig.gateway.requests) == 1  # nothing of a queued turn reached the model
    release.set()
    ended = await rig.service.wait_for_end(third.turn.turn_id)
    assert ended.end_reason is TurnEndReason.COMPLETED
    turns = [rig.store.turns[a.turn.turn_id] for a in (first, second, third)]
    assert all(t.end_reason is TurnEndReason.COMPLETED for t in turns)
    # One at a time, in acceptance order: each started after the one before ended.
    for before, after in itertools.pairwise(turns):
        assert before.end_time is not None and before.end_time <= after.start_time
        assert after.owner == "r1"
    # The transcript stores each human message where its turn starts.
    transcript = [(m.kind, m.text) for m in rig.store.messages["s1"]]
    assert transcript == [
        (MessageKind.HUMAN, "first"),
        (MessageKind.ASSISTANT, "One"),
        (MessageKind.HUMAN, "second"),
        (MessageKind.ASSISTANT, "answer to second"),
        (MessageKind.HUMAN, "third"),
        (MessageKind.ASSISTANT, "answer to third"),
    ]
    assert [last_human(r) for r in rig.gateway.requests] == ["first", "second", "third"]
    kinds = [e.kind for e in rig.store.events["s1"]]
    assert kinds[:4] == [
        EventKind.MESSAGE_ACCEPTED,
        EventKind.TURN_STARTED,
        EventKind.MESSAGE_QUEUED,
        EventKind.MESSAGE_QUEUED,
    ]


async def test_reject_is_the_default_and_the_queue_has_a_bound() -> None:
    release = asyncio.Event()
    rig = make_rig(held_first_answer(release), max_queued=1)
    await send(rig, "first", OnBusy.REJECT)
    await rig.gateway.started.wait()

    with pytest.raises(FailedPrecondition) as busy:
        await send(rig, "refused", OnBusy.REJECT)
    await send(rig, "queued", OnBusy.ENQUEUE)
    with pytest.raises(ResourceExhausted) as full:
        await send(rig, "one too many", OnBusy.ENQUEUE)

    assert busy.value.reason == "TURN_IN_PROGRESS"
    assert full.value.reason == "QUEUE_FULL"
    release.set()


async def test_a_cancelled_queued_turn_never_reaches_the_model() -> None:
    release = asyncio.Event()
    rig = make_rig(held_first_answer(release))
    await send(rig, "first", OnBusy.REJECT)
    await rig.gateway.started.wait()
    second = await send(rig, "second", OnBusy.ENQUEUE)
    third = await send(rig, "third", OnBusy.ENQUEUE)
    session = await rig.store.get_session("s1")
    assert session is not None

    cancelled = await rig.service.cancel(session, second.turn.turn_id)

    assert cancelled.state is TurnState.ENDED
    assert cancelled.end_reason is TurnEndReason.CANCELLED
    release.set()
    await rig.service.wait_for_end(third.turn.turn_id)
    assert [last_human(r) for r in rig.gateway.requests] == ["first", "third"]
    assert "second" not in [m.text for m in rig.store.messages["s1"]]


async def test_a_resent_request_id_never_queues_twice() -> None:
    release = asyncio.Event()
    rig = make_rig(held_first_answer(release))
    await send(rig, "first", OnBusy.REJECT)
    await rig.gateway.started.wait()

    queued = await send(rig, "second", OnBusy.ENQUEUE, request_id="r-2")
    again = await send(rig, "second", OnBusy.ENQUEUE, request_id="r-2")
    interrupt = await send(rig, "stop", OnBusy.INTERRUPT, request_id="r-3")
    interrupt_again = await send(rig, "stop", OnBusy.INTERRUPT, request_id="r-3")

    assert again.duplicate and again.turn.turn_id == queued.turn.turn_id
    assert again.message_accepted == queued.message_accepted
    assert interrupt_again.duplicate and interrupt_again.turn.turn_id == interrupt.turn.turn_id
    assert sum(t.state is not TurnState.RUNNING for t in rig.store.turns.values()) == 2
    await rig.service.wait_for_end(queued.turn.turn_id)
    assert [last_human(r) for r in rig.gateway.requests] == ["first", "stop", "second"]


async def test_an_interrupt_stops_a_write_in_flight_and_its_turn_sees_the_transcript() -> None:
    def script(request: ModelRequest) -> dict[str, Any]:
        if last_role(request) is Role.USER and last_human(request) == "first":
            return {"chunks": ["Writing. "], "tool_calls": [("propose_changeset", PROPOSAL)]}
        return {"text": f"answer to {last_human(request)}"}

    rig = make_rig(script, cancel_grace_s=0.2)
    rig.backends.block["propose_changeset"] = asyncio.Event()  # never released
    first = await send(rig, "first", OnBusy.REJECT)
    await rig.backends.reached("propose_changeset").wait()
    started = rig.clock.monotonic()

    interrupt = await send(rig, "no, the other epic", OnBusy.INTERRUPT)

    assert interrupt.queued and interrupt.turn.behind_turn_id == first.turn.turn_id
    ended = await rig.service.wait_for_end(first.turn.turn_id)
    assert ended.end_reason is TurnEndReason.INTERRUPTED_BY_MESSAGE
    assert rig.clock.monotonic() - started <= 0.2 + 1.0
    await rig.service.wait_for_end(interrupt.turn.turn_id)
    old = [m for m in rig.store.messages["s1"] if m.turn_id == first.turn.turn_id]
    calls = {m.tool_call_id for m in old if m.kind is MessageKind.TOOL_CALL}
    results = [m for m in old if m.kind is MessageKind.TOOL_RESULT]
    assert calls and calls == {m.tool_call_id for m in results}
    assert "outcome is unknown" in results[0].tool_result
    # The new turn's first model request holds the interrupted turn's transcript.
    request = rig.gateway.requests[-1]
    roles = [m.role for m in request.messages]
    assert roles[-4:] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.USER]
    assert request.messages[-1].text == "no, the other epic"


async def test_the_sweeper_starts_the_queued_turn_of_a_dead_replica() -> None:
    release = asyncio.Event()
    rig = make_rig(held_first_answer(release))
    first = await send(rig, "first", OnBusy.REJECT)
    await rig.gateway.started.wait()
    queued = await send(rig, "second", OnBusy.ENQUEUE)
    # The first turn's replica "dies": its turn is another replica's, whose lease lapsed.
    dead = replace(
        rig.store.turns[first.turn.turn_id], owner="r-dead", lease_expires_at=rig.clock.now()
    )
    rig.store.turns[first.turn.turn_id] = dead
    rig.service._handles.pop(first.turn.turn_id)
    rig.clock.advance(1)

    assert await rig.service.sweep() == 1

    ended = await rig.service.wait_for_end(queued.turn.turn_id)
    assert ended.end_reason is TurnEndReason.COMPLETED and ended.owner == "r1"
    assert rig.store.turns[first.turn.turn_id].end_reason is TurnEndReason.INTERRUPTED
    release.set()


async def test_a_join_sent_during_a_tool_round_is_in_the_next_model_request() -> None:
    def script(request: ModelRequest) -> dict[str, Any]:
        if last_role(request) is Role.USER and last_human(request) == "first":
            return {"tool_calls": [("list_items", '{"kind":"epic"}')]}
        return {"text": f"answer to {last_human(request)}"}

    rig = make_rig(script)
    rig.backends.block["list_items"] = blocker = asyncio.Event()
    first = await send(rig, "first", OnBusy.REJECT)
    await rig.backends.reached("list_items").wait()

    join = await send(rig, "only the open ones", OnBusy.JOIN)
    blocker.set()

    assert join.queued
    ended = await rig.service.wait_for_end(first.turn.turn_id)
    assert ended.end_reason is TurnEndReason.COMPLETED
    joined = rig.store.turns[join.turn.turn_id]
    assert joined.end_reason is TurnEndReason.JOINED
    second = rig.gateway.requests[1]
    roles = [m.role for m in second.messages]
    assert roles[-3:] == [Role.ASSISTANT, Role.TOOL, Role.USER]
    assert second.messages[-1].text == "only the open ones"
    transcript = [(m.kind, m.turn_id, m.text) for m in rig.store.messages["s1"]]
    assert transcript[-2:] == [
        (MessageKind.HUMAN, first.turn.turn_id, "only the open ones"),
        (MessageKind.ASSISTANT, first.turn.turn_id, "answer to only the open ones"),
    ]
    assert len(rig.gateway.requests) == 2


async def test_a_join_sent_while_the_final_text_streams_starts_the_next_turn() -> None:
    release = asyncio.Event()
    rig = make_rig(held_first_answer(release))
    first = await send(rig, "first", OnBusy.REJECT)
    await rig.gateway.started.wait()

    join = await send(rig, "second", OnBusy.JOIN)
    release.set()

    ended = await rig.service.wait_for_end(join.turn.turn_id)
    assert ended.end_reason is TurnEndReason.COMPLETED
    assert rig.store.turns[first.turn.turn_id].end_reason is TurnEndReason.COMPLETED
    assert [last_human(r) for r in rig.gateway.requests] == ["first", "second"]
    human = next(m for m in rig.store.messages["s1"] if m.text == "second")
    assert human.turn_id == join.turn.turn_id
