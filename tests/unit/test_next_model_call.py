"""The next model call opens while a round's last results commit (decision 0391), is
taken over once they are durable, and is cancelled when they are not.

The round's commit is held by a store that parks the commit of the tool results until
the test lets it go (or fails it), so "the next model call is in flight while the round
commits" is a state the test waits for, never a race.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from service.core.errors import StoreConflict, StoreUnavailable
from service.core.fanout import Hub, StreamQueue
from service.core.model import (
    EventKind,
    OnBusy,
    SessionEvent,
    TextDelta,
    TurnEndReason,
    TurnState,
)
from service.core.ports import ModelChunk, ModelRequest, TurnCommit
from service.core.turn import TurnService
from tests.unit.fakes import tool_results_in_turn
from tests.unit.test_early_model_call import (
    ClosingGateway,
    HeldStore,
    Outcomes,
    drain,
    outcomes,
)
from tests.unit.test_turn import Rig, make_rig

WAIT_S = 10.0


class HeldRound(HeldStore):
    """A ``HeldStore`` whose first commit of tool results is held."""

    def __init__(self) -> None:
        super().__init__(hold=True)

    async def commit(self, commit: TurnCommit) -> list[SessionEvent]:
        if self.hold and any(e.kind is EventKind.TOOL_CALL_FINISHED for e in commit.events):
            await self.held()
        return await super().commit(commit)


class SecondCall(ClosingGateway):
    """A ``ClosingGateway`` that says when a second call sent its first chunk."""

    def __init__(self, script: Any) -> None:
        super().__init__(script)
        self.second = asyncio.Event()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelChunk]:
        async for chunk in super().stream(request):
            if len(self.requests) >= 2:
                self.second.set()
            yield chunk


def one_round(request: ModelRequest) -> dict[str, Any]:
    if not tool_results_in_turn(request):
        return {"tool_calls": [("list_items", '{"kind":"epic"}')], "usage": (1000, 20)}
    return {"chunks": ["Here ", "they are."], "usage": (1200, 30)}


def held_rig(**settings: Any) -> tuple[Rig, HeldRound, SecondCall]:
    """``make_rig``'s turn service over a ``HeldRound`` store and a ``SecondCall`` gateway;
    its observer is an ``Outcomes``."""
    base = make_rig(one_round, **settings)
    store = HeldRound()
    store.add_session(base.session)
    gateway = SecondCall(one_round)
    hub = Hub(store.events_after)
    deps = replace(base.service._deps, store=store, gateway=gateway, hub=hub, observer=Outcomes())
    rig = Rig(TurnService(deps), store, gateway, base.backends, hub, base.clock, base.session)
    return rig, store, gateway


async def round_in_flight(
    fail: BaseException | None = None, **settings: Any
) -> tuple[Rig, HeldRound, SecondCall, StreamQueue, str]:
    """A one-round turn whose tool result's commit is held (failing with ``fail`` once
    let go), with a stream attached from the session's start; returns when the next model
    call has sent its first delta."""
    rig, store, gateway = held_rig(**settings)
    store.failure = fail
    queue = rig.hub.attach(rig.session.session_id, "alice", 0)
    turn_id = await rig.send("list the epics")
    async with asyncio.timeout(WAIT_S):
        await store.begun.wait()
        await gateway.second.wait()
    # Passes enough for a delta to reach the stream, were it relayed.
    for _ in range(20):
        await asyncio.sleep(0)
    return rig, store, gateway, queue, turn_id


def kinds(items: list[object]) -> list[object]:
    return [item.kind if isinstance(item, SessionEvent) else type(item).__name__ for item in items]


async def test_the_next_model_call_streams_while_the_round_commits_and_is_relayed_after() -> None:
    rig, store, gateway, queue, turn_id = await round_in_flight()
    # The model answers while the result is not durable: neither the result nor anything
    # of the answer reaches a stream.
    held = kinds(drain(queue))
    assert EventKind.TOOL_CALL_FINISHED not in held
    assert "TextDelta" not in held
    assert tool_results_in_turn(gateway.requests[1]) == 1

    store.let_go.set()
    turn = await rig.service.wait_for_end(turn_id)
    assert turn.state is TurnState.ENDED
    assert turn.end_reason is TurnEndReason.COMPLETED
    # Taken over: no third request, none cancelled.
    assert len(gateway.requests) == 2
    assert gateway.cancelled == []
    assert outcomes(rig) == ["taken"]
    sent = drain(queue)
    order = kinds(sent)
    assert order.index(EventKind.TOOL_CALL_FINISHED) < order.index("TextDelta")
    assert "".join(i.text for i in sent if isinstance(i, TextDelta)) == "Here they are."
    assert [m.text for m in store.messages["s1"]][-1] == "Here they are."


async def test_a_round_that_fails_to_commit_cancels_the_next_call_and_relays_nothing() -> None:
    rig, store, gateway, queue, turn_id = await round_in_flight(
        StoreUnavailable("the database is unavailable")
    )
    drain(queue)
    store.let_go.set()
    turn = await rig.service.wait_for_end(turn_id)
    assert turn.end_reason is TurnEndReason.FAILED
    async with asyncio.timeout(WAIT_S):
        await gateway.closed_early.wait()
    assert gateway.cancelled == [gateway.requests[1]]
    assert len(gateway.requests) == 2
    # Closed from what is stored (the round gets the closing's results): nothing of the
    # answer streamed meanwhile is relayed.
    assert not [item for item in drain(queue) if isinstance(item, TextDelta)]
    assert outcomes(rig) == ["cancelled"]


async def test_a_turn_stopped_while_its_round_commits_cancels_the_next_call() -> None:
    rig, store, gateway, queue, turn_id = await round_in_flight()
    await rig.service.stop(0.0)
    store.let_go.set()
    async with asyncio.timeout(WAIT_S):
        turn = await rig.service.wait_for_end(turn_id)
        await gateway.closed_early.wait()
    assert turn.end_reason is not TurnEndReason.COMPLETED
    assert gateway.cancelled == [gateway.requests[1]]
    assert not [item for item in drain(queue) if isinstance(item, TextDelta)]
    assert outcomes(rig) == ["cancelled"]


async def test_no_call_opens_after_the_last_round_a_turn_may_run() -> None:
    rig, store, gateway = held_rig(max_rounds=1)
    turn_id = await rig.send("list the epics")
    async with asyncio.timeout(WAIT_S):
        await store.begun.wait()
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(gateway.requests) == 1
    store.let_go.set()
    turn = await rig.service.wait_for_end(turn_id)
    assert turn.end_reason is TurnEndReason.MAX_ROUNDS
    assert len(gateway.requests) == 1
    assert outcomes(rig) == []


async def test_a_commit_refused_by_the_store_cancels_the_next_call() -> None:
    # Another replica took the turn over (a conflict): this replica abandons the turn and
    # must not leave the call open.
    rig, store, gateway, queue, _ = await round_in_flight(StoreConflict("another owner"))
    store.let_go.set()
    async with asyncio.timeout(WAIT_S):
        await gateway.closed_early.wait()
    assert gateway.cancelled == [gateway.requests[1]]
    assert not [item for item in drain(queue) if isinstance(item, TextDelta)]
    assert outcomes(rig) == ["cancelled"]


async def test_a_message_joining_while_the_round_commits_replaces_the_call_opened_ahead() -> None:
    rig, store, gateway, queue, turn_id = await round_in_flight()
    joined = await rig.accept("only the open ones", on_busy=OnBusy.JOIN)
    assert not joined.duplicate
    store.let_go.set()
    turn = await rig.service.wait_for_end(turn_id)
    assert turn.end_reason is TurnEndReason.COMPLETED
    async with asyncio.timeout(WAIT_S):
        await gateway.closed_early.wait()
    # The call opened ahead lacked the joined message: cancelled, and the loop made its
    # own with it (the script answers a human message last with a tool call: a second
    # round, whose next call was opened ahead and taken).
    ahead, made = gateway.requests[1:3]
    assert gateway.cancelled == [ahead]
    assert "only the open ones" not in [m.text for m in ahead.messages]
    assert "only the open ones" in [m.text for m in made.messages]
    assert outcomes(rig) == ["cancelled", "taken"]
    assert "".join(i.text for i in drain(queue) if isinstance(i, TextDelta)) == "Here they are."
