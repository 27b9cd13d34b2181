"""The early model call (decision 0380): a turn's first model call opened while its start
commits, taken over once the start is durable, cancelled when it is not.

The start's commit is held by a store that parks ``start_turn`` until the test lets it
go (or fails it), so "the model call is in flight while the start commits" is a state the
test waits for, never a race.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from service.core.errors import FailedPrecondition, StoreUnavailable
from service.core.fanout import Hub, StreamQueue
from service.core.model import EventKind, SessionEvent, TextDelta, TurnState
from service.core.ports import (
    ContextSnapshot,
    ModelChunk,
    ModelRequest,
    SkillDocument,
    TurnStart,
    TurnStartOutcome,
)
from service.core.tracing import NULL_SPAN
from service.core.turn import NullObserver, TurnService
from service.server.metrics import Metrics
from service.server.observer import PrometheusTurnObserver
from tests.memory_store import MemoryStore
from tests.unit.fakes import ScriptedGateway
from tests.unit.test_turn import Rig, make_rig

WAIT_S = 10.0


class HeldStore(MemoryStore):
    """A memory store that can park one unit of work (``held``, called by a subclass's
    method while ``hold`` is set): it says it has begun (``begun``), waits for ``let_go``,
    then raises ``failure`` if one is set, else lets the unit go on."""

    def __init__(self, hold: bool = False) -> None:
        super().__init__()
        self.hold = hold
        self.begun = asyncio.Event()
        self.let_go = asyncio.Event()
        self.failure: BaseException | None = None

    async def held(self) -> None:
        self.hold = False
        self.begun.set()
        await self.let_go.wait()
        if self.failure is not None:
            raise self.failure


class HeldStart(HeldStore):
    """A ``HeldStore`` whose next ``start_turn`` is held once ``hold`` is set."""

    async def start_turn(self, start: TurnStart) -> TurnStartOutcome:
        if self.hold:
            await self.held()
        return await super().start_turn(start)


class ClosingGateway(ScriptedGateway):
    """A scripted gateway that records which of its streams were closed before their
    end (a cancelled model call)."""

    def __init__(self, script: Any) -> None:
        super().__init__(script)
        self.cancelled: list[ModelRequest] = []
        self.closed_early = asyncio.Event()
        self.first_sent = asyncio.Event()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelChunk]:
        finished = False
        try:
            async for chunk in super().stream(request):
                self.first_sent.set()
                yield chunk
            finished = True
        finally:
            if not finished:
                self.cancelled.append(request)
                self.closed_early.set()


def answer(_: ModelRequest) -> dict[str, Any]:
    return {"chunks": ["Hello ", "there."], "usage": (100, 5)}


class Outcomes(NullObserver):
    """The early calls' outcomes, as the metrics see them."""

    def __init__(self) -> None:
        self.early: list[str] = []

    def early_model_call(self, outcome: str) -> None:
        self.early.append(outcome)


def held_rig(
    script: Any = answer, store: HeldStart | None = None
) -> tuple[Rig, HeldStart, ClosingGateway]:
    """``make_rig``'s turn service over ``store`` (a new ``HeldStart`` by default) and a
    ``ClosingGateway``; its observer is an ``Outcomes`` (``rig.service._deps.observer``)."""
    base = make_rig(script)
    store = HeldStart() if store is None else store
    store.add_session(base.session)
    gateway = ClosingGateway(script)
    hub = Hub(store.events_after)
    deps = replace(base.service._deps, store=store, gateway=gateway, hub=hub, observer=Outcomes())
    rig = Rig(TurnService(deps), store, gateway, base.backends, hub, base.clock, base.session)
    return rig, store, gateway


def last_sequence(store: MemoryStore) -> int:
    return store.sessions["s1"].last_sequence


def drain(queue: StreamQueue) -> list[object]:
    """What a stream was sent so far, in order (events and deltas)."""
    items: list[object] = []
    while queue._items:
        items.append(queue._items.popleft()[0])
    return items


async def second_turn_in_flight(
    fail: BaseException | None = None, *, held: bool = True
) -> tuple[Rig, HeldStart, ClosingGateway, StreamQueue, asyncio.Future[str]]:
    """A rig whose session had one turn, a stream attached, and a second message sent
    whose start is held (failing with ``fail`` once let go) while its early model call
    has sent its first delta; ``held``: the answer then stays open, else it ends as
    ``answer``."""
    block = asyncio.Event()

    def script(request: ModelRequest) -> dict[str, Any]:
        if not held:
            return answer(request)
        return {"chunks": ["partial"], "block": block, "usage": (100, 5)}

    rig, store, gateway = held_rig(script)
    block.set()
    await rig.run("first")
    block.clear()
    queue = rig.hub.attach(rig.session.session_id, "alice", last_sequence(store))
    store.hold = True
    store.failure = fail
    gateway.first_sent.clear()
    sending = asyncio.ensure_future(rig.send("second"))
    async with asyncio.timeout(WAIT_S):
        await store.begun.wait()
        await gateway.first_sent.wait()
    assert len(gateway.requests) == 2
    return rig, store, gateway, queue, sending


async def test_a_later_turn_streams_its_first_model_call_while_its_start_commits() -> None:
    # The first turn keeps the session's context and the prompt in memory.
    rig, store, gateway, queue, sending = await second_turn_in_flight(held=False)
    # The model answers while the start is not durable: nothing of it reaches a stream.
    assert drain(queue) == []
    assert not sending.done()

    store.let_go.set()
    turn_id = await sending
    turn = await rig.service.wait_for_end(turn_id)
    assert turn.state is TurnState.ENDED
    # Taken over: no second request for the turn's first model call, none cancelled.
    assert len(gateway.requests) == 2
    assert gateway.cancelled == []
    sent = drain(queue)
    kinds = [item.kind if isinstance(item, SessionEvent) else "delta" for item in sent]
    assert kinds[:2] == [EventKind.MESSAGE_ACCEPTED, EventKind.TURN_STARTED]
    assert "delta" in kinds
    assert kinds[-1] is EventKind.TURN_ENDED
    deltas = [item.text for item in sent if isinstance(item, TextDelta)]
    assert "".join(deltas) == "Hello there."
    assert outcomes(rig) == ["taken"]
    messages = store.messages["s1"]
    assert [m.text for m in messages][-2:] == ["second", "Hello there."]


@pytest.mark.parametrize(
    "failure",
    [
        StoreUnavailable("the database is unavailable"),
        FailedPrecondition("another turn is running", reason="TURN_IN_PROGRESS"),
    ],
    ids=["the-commit-fails", "the-start-is-refused"],
)
async def test_a_start_that_is_not_stored_cancels_the_call_in_flight_and_sends_nothing(
    failure: BaseException,
) -> None:
    rig, store, gateway, queue, sending = await second_turn_in_flight(failure)
    # (The start is held: nothing of the second message is stored yet.)
    events_before = list(store.events["s1"])
    store.let_go.set()
    with pytest.raises(type(failure)):
        await sending

    async with asyncio.timeout(WAIT_S):
        await gateway.closed_early.wait()
    assert gateway.cancelled == [gateway.requests[1]]
    # Nothing of the cancelled call was sent, and nothing was stored for the message.
    assert drain(queue) == []
    assert store.events["s1"] == events_before
    assert rig.service.running == 0
    assert outcomes(rig) == ["cancelled"]


async def test_the_first_turn_of_a_session_and_a_retried_message_open_no_early_call() -> None:
    rig, store, gateway = held_rig()
    store.hold = True
    sending = asyncio.ensure_future(rig.send("first", request_id="r-1"))
    async with asyncio.timeout(WAIT_S):
        await store.begun.wait()
    # The prompt is not in memory before the first turn: nothing is asked of the model
    # until the start is durable.
    for _ in range(20):
        await asyncio.sleep(0)
    assert gateway.requests == []
    store.let_go.set()
    await rig.service.wait_for_end(await sending)
    assert len(gateway.requests) == 1

    # The same request id again: a duplicate, answered from the store, no model call.
    duplicate = await rig.accept("first", request_id="r-1")
    assert duplicate.duplicate
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(gateway.requests) == 1
    assert gateway.cancelled == []


async def test_a_turn_stopped_before_its_first_model_call_cancels_the_early_one() -> None:
    rig, store, gateway, queue, sending = await second_turn_in_flight()
    # A shutdown while the start commits: the turn is stored, then stops at once.
    await rig.service.stop(0.0)
    store.let_go.set()
    turn_id = await sending
    async with asyncio.timeout(WAIT_S):
        await rig.service.wait_for_end(turn_id)
        await gateway.closed_early.wait()
    assert gateway.cancelled == [gateway.requests[1]]
    sent = drain(queue)
    assert not [item for item in sent if isinstance(item, TextDelta)]
    kinds = [item.kind for item in sent if isinstance(item, SessionEvent)]
    assert kinds == [EventKind.MESSAGE_ACCEPTED, EventKind.TURN_STARTED, EventKind.TURN_ENDED]


class OrderedStart(HeldStart):
    """A ``HeldStart`` that records, in order, the starts it began and the kept
    contexts it was asked for (an early request reads the kept context)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def kept_context(self, session_id: str) -> ContextSnapshot | None:
        self.calls.append("kept_context")
        return super().kept_context(session_id)

    async def start_turn(self, start: TurnStart) -> TurnStartOutcome:
        self.calls.append("start_turn")
        return await super().start_turn(start)


async def test_the_start_is_under_way_before_the_early_request_is_built() -> None:
    # Decision 0394: the start's unit of work goes first (PostgreSQL runs it while the
    # early request is built and sent), then the early call's request is built.
    store = OrderedStart()
    rig, _, gateway = held_rig(store=store)
    await rig.run("first")
    store.calls.clear()
    store.hold = True
    gateway.first_sent.clear()
    sending = asyncio.ensure_future(rig.send("second"))
    async with asyncio.timeout(WAIT_S):
        await store.begun.wait()
        await gateway.first_sent.wait()
    assert store.calls[:2] == ["start_turn", "kept_context"]
    store.let_go.set()
    turn = await rig.service.wait_for_end(await sending)
    assert turn.state is TurnState.ENDED
    assert len(gateway.requests) == 2 and gateway.cancelled == []


class OrderedLoad(OrderedStart):
    """An ``OrderedStart`` that also records the loop's first step (its context read)."""

    async def load_context(self, session_id: str) -> ContextSnapshot | None:
        self.calls.append("load_context")
        return await super().load_context(session_id)


async def test_the_start_is_told_before_the_turn_runs() -> None:
    # Decision 0399: a stream takes message_accepted (which a first delta must follow)
    # before the turn's first step runs; the turn's model call is open already.
    store = OrderedLoad()
    rig, _, _ = held_rig(store=store)
    await rig.run("first")
    queue = rig.hub.attach(rig.session.session_id, "alice", last_sequence(store))

    async def take() -> None:
        while True:
            item = await queue.get()
            if isinstance(item, SessionEvent):
                store.calls.append(f"taken {item.kind.value}")

    taking = asyncio.get_running_loop().create_task(take())
    try:
        store.calls.clear()
        await rig.run("second")
        assert store.calls.index("taken message_accepted") < store.calls.index("load_context")
    finally:
        taking.cancel()


async def test_an_early_call_the_turn_would_not_make_is_cancelled_and_made_again() -> None:
    rig, store, gateway = held_rig()
    rig.backends.skill = SkillDocument("demo-planning", "1.0.0", "Always estimate.")
    await rig.run("first")
    store.hold = True
    gateway.first_sent.clear()
    sending = asyncio.ensure_future(rig.send("second"))
    async with asyncio.timeout(WAIT_S):
        await store.begun.wait()
        # The early call is opened once the start's unit of work is under way.
        await gateway.first_sent.wait()
    # While the start commits, the project's skill changes and the directory's answers
    # expire: the turn's prompt differs from the early call's.
    rig.backends.skill = SkillDocument("demo-planning", "1.0.1", "Never estimate.")
    rig.service._prompts._directory._cache.clear()
    store.let_go.set()
    turn = await rig.service.wait_for_end(await sending)
    assert turn.state is TurnState.ENDED
    async with asyncio.timeout(WAIT_S):
        await gateway.closed_early.wait()
    early, made = gateway.requests[1:]
    assert gateway.cancelled == [early]
    assert "Always estimate." in early.system_context
    assert "Never estimate." in made.system_context
    assert outcomes(rig) == ["differed"]
    assert store.messages["s1"][-1].text == "Hello there."


class Traced:
    """A tracer under which every message arrives with a span current."""

    def span(self, *_: object, **__: object) -> Any:
        return NULL_SPAN

    def current(self) -> object:
        return "a span"


async def test_a_traced_message_opens_no_early_call() -> None:
    rig, store, gateway = held_rig()
    await rig.run("first")
    object.__setattr__(rig.service._deps, "tracer", Traced())
    store.hold = True
    sending = asyncio.ensure_future(rig.send("second"))
    async with asyncio.timeout(WAIT_S):
        await store.begun.wait()
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(gateway.requests) == 1
    store.let_go.set()
    await rig.service.wait_for_end(await sending)
    assert len(gateway.requests) == 2
    assert gateway.cancelled == []


def outcomes(rig: Rig) -> list[str]:
    observer = rig.service._deps.observer
    assert isinstance(observer, Outcomes)
    return observer.early


def test_the_outcomes_are_exported_by_outcome() -> None:
    metrics = Metrics()
    observer = PrometheusTurnObserver(metrics)
    for outcome in ("taken", "taken", "cancelled", "differed"):
        observer.early_model_call(outcome)
    name = "ballet_planner_early_model_calls_total"
    counts = {
        outcome: metrics.registry.get_sample_value(name, {"outcome": outcome})
        for outcome in ("taken", "cancelled", "differed")
    }
    assert counts == {"taken": 2.0, "cancelled": 1.0, "differed": 1.0}
