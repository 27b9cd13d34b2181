"""A seeded random driver for messages sent while turns run (decisions 0300, 0301).

Three humans, one session each, send messages with random ``on_busy`` strategies to
random replicas (``TurnService`` instances of different replica ids sharing one store)
while turns run, read and write tools, get cancelled (running or queued), and replicas
get killed (their runs cancelled mid-step, their turns left running until another
replica's sweeper ends them) and replaced. A resend of an acknowledged request id is
mixed in. At the end, with every session idle:

- every acknowledged message was answered in exactly one turn: its turn ended, and its
  human message is in the transcript once, in its own turn or, for a JOIN, in the turn
  it joined, unless its queued turn was cancelled first;
- turns of a session never overlap, and each turn started and ended at most once;
- queued turns started in acceptance order (INTERRUPTs first, each group in order);
- no queued turn is left, and a resend never queued twice;
- every tool call has exactly one result; sequences have no gaps.

Seeds are fixed so a failure reproduces; the six run in about 10 s on a loaded machine
(160 steps, 55 to 66 acknowledged messages, 30 to 48 of them queued, each).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest

from service.core.errors import FailedPrecondition, ResourceExhausted
from service.core.fanout import Hub
from service.core.model import (
    EventKind,
    MessageKind,
    MessageQueuedData,
    OnBusy,
    Session,
    TurnEndReason,
    TurnState,
)
from service.core.ports import ModelRequest, Purpose, Role
from service.core.tools import ToolRunner, declarations
from service.core.turn import SendRequest, TurnDependencies, TurnService, TurnSettings
from tests.memory_store import MemoryStore
from tests.unit.fakes import FakeBackends, FakeClock, ScriptedGateway, last_role

#: The run of each seed covers every strategy and ending (asserted below); seeds 4 and 5
#: stopped covering JOINED once first model calls open while their start commits
#: (decision 0380: turns answer sooner), though their invariants hold; 7 and 8 took
#: their places.
SEEDS = (1, 2, 3, 6, 7, 8)
STEPS = 160
HUMANS = ("alice", "bob", "carol")
PROPOSAL = json.dumps(
    {"title": "t", "operations": [{"create_item": {"kind": "ticket", "title": "x"}}]}
)
LEASE_S = 15.0


@dataclass
class World:
    """The shared store and clock, the live replicas, and what was acknowledged."""

    rng: random.Random
    store: MemoryStore = field(default_factory=MemoryStore)
    clock: FakeClock = field(default_factory=FakeClock)
    backends: FakeBackends = field(default_factory=FakeBackends)
    replicas: list[TurnService] = field(default_factory=list)
    born: int = 0
    #: request id -> (turn id, strategy) of every acknowledged message.
    acknowledged: dict[str, tuple[str, OnBusy]] = field(default_factory=dict)
    #: request id -> the text it sent.
    texts: dict[str, str] = field(default_factory=dict)
    background: set[asyncio.Task[Any]] = field(default_factory=set)

    def script(self, request: ModelRequest) -> dict[str, Any]:
        if request.purpose is Purpose.COMPACTION:
            return {"text": "SUMMARY", "usage": (10, 5)}
        pieces = [f"p{n} " for n in range(self.rng.randint(4, 40))]
        if last_role(request) is Role.USER and self.rng.random() < 0.6:
            call = self.rng.choice(
                [("list_items", '{"kind":"epic"}'), ("propose_changeset", PROPOSAL)]
            )
            return {"chunks": pieces, "tool_calls": [call], "usage": (100, 10)}
        return {"chunks": pieces, "usage": (100, 10)}

    def new_replica(self) -> TurnService:
        self.born += 1
        service = TurnService(
            TurnDependencies(
                store=self.store,
                gateway=ScriptedGateway(self.script),
                backends=self.backends,
                hub=Hub(self.store.events_after),
                clock=self.clock,
                settings=TurnSettings(
                    model="m", max_rounds=3, cancel_grace_s=0.05, lease_s=LEASE_S, max_queued=4
                ),
                replica_id=f"r{self.born}",
                tools=ToolRunner(self.backends),
                declarations=declarations(),
            )
        )
        self.replicas.append(service)
        return service

    def spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def deliver_cancels(self) -> None:
        """The notifier: a cancel flagged in the store reaches the replica running it."""
        for replica in self.replicas:
            for handle in list(replica._handles.values()):
                turn = self.store.turns.get(handle.turn_id)
                if turn is not None and turn.cancel_requested and not handle.stopping:
                    await replica.on_remote_cancel(handle.turn_id)

    async def kill(self, victim: TurnService) -> None:
        """SIGKILL: the runs stop where they are; their turns stay running in the store."""
        self.replicas.remove(victim)
        tasks = [*victim._tasks.values(), *victim._promoting]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.new_replica()

    async def sweep(self) -> None:
        """Leases lapse for the dead: the live renew theirs, then one of them sweeps."""
        self.clock.advance(LEASE_S + 1)
        for replica in self.replicas:
            await replica._leases.renew()
        await self.rng.choice(self.replicas).sweep()

    def busy(self) -> bool:
        return any(t.state is not TurnState.ENDED for t in self.store.turns.values())


async def _send(world: World, session: Session, step: int) -> None:
    rng = world.rng
    replica = rng.choice(world.replicas)
    resend = world.acknowledged and rng.random() < 0.1
    if resend:
        request_id = rng.choice(sorted(world.acknowledged))
        turn_id, on_busy = world.acknowledged[request_id]
        text = world.texts[request_id]
        if world.store.turns[turn_id].session_id != session.session_id:
            return
    else:
        request_id = f"req-{step}"
        on_busy = rng.choice(list(OnBusy))
        text = f"message {step}"
    stored = await world.store.get_session(session.session_id)
    assert stored is not None
    try:
        accepted = await replica.send_message(
            SendRequest(
                session=stored,
                human_id=session.owner_id,
                organization_id="acme",
                token=f"token-{session.owner_id}",
                text=text,
                request_id=request_id,
                on_busy=on_busy,
            )
        )
    except (FailedPrecondition, ResourceExhausted):
        assert not resend
        return
    if resend:
        assert accepted.duplicate and accepted.turn.turn_id == turn_id
        return
    assert not accepted.duplicate
    world.acknowledged[request_id] = (accepted.turn.turn_id, on_busy)
    world.texts[request_id] = text


async def _cancel(world: World, session: Session) -> None:
    waiting = [
        t
        for t in world.store.turns.values()
        if t.session_id == session.session_id and t.state is not TurnState.ENDED
    ]
    if waiting:
        target = world.rng.choice(waiting)
        stored = await world.store.get_session(session.session_id)
        assert stored is not None
        world.spawn(world.rng.choice(world.replicas).cancel(stored, target.turn_id))


async def _drive(number: int) -> World:
    world = World(random.Random(number))
    world.new_replica()
    world.new_replica()
    sessions = [
        world.store.add_session(
            Session(
                session_id=f"s-{human}",
                project_id="demo",
                organization_id="acme",
                owner_id=human,
                title=human,
                create_time=world.clock.now(),
                update_time=world.clock.now(),
            )
        )
        for human in HUMANS
    ]
    rng = world.rng
    kills = 0
    for step in range(STEPS):
        session = rng.choice(sessions)
        roll = rng.random()
        if roll < 0.55:
            await _send(world, session, step)
        elif roll < 0.65:
            await _cancel(world, session)
        elif roll < 0.67 and kills < 2:
            kills += 1
            await world.kill(rng.choice(world.replicas))
            await world.sweep()
        for _ in range(rng.randint(0, 6)):
            await asyncio.sleep(0)
        await world.deliver_cancels()
    # Let everything finish: deliver cancels, sweep what the dead left, until idle.
    for _ in range(2000):
        if not world.busy() and not world.background:
            break
        await world.deliver_cancels()
        if not any(r.running for r in world.replicas) and world.busy():
            await world.sweep()
        await asyncio.sleep(0.001)
    assert not world.busy(), "some turn never ended"
    if world.background:
        await asyncio.gather(*world.background)
    return world


def _check(world: World) -> None:
    store = world.store
    for session_id, events in store.events.items():
        assert [e.sequence for e in events] == list(range(1, len(events) + 1))
        running = ""
        started: list[str] = []
        ended: set[str] = set()
        queued_order: dict[str, tuple[int, int]] = {}
        for event in events:
            if event.kind is EventKind.MESSAGE_QUEUED:
                assert isinstance(event.data, MessageQueuedData)
                priority = 1 if event.data.on_busy is OnBusy.INTERRUPT else 0
                queued_order[event.turn_id] = (priority, event.sequence)
            elif event.kind is EventKind.TURN_STARTED:
                assert not running, f"{event.turn_id} started while {running} ran"
                assert event.turn_id not in started, f"{event.turn_id} started twice"
                running = event.turn_id
                started.append(event.turn_id)
            elif event.kind is EventKind.TURN_ENDED:
                assert event.turn_id not in ended, f"{event.turn_id} ended twice"
                ended.add(event.turn_id)
                if event.turn_id == running:
                    running = ""
                else:
                    # Only a queued turn ends without having started: cancelled, or its
                    # JOIN message joined the running turn.
                    assert event.turn_id not in started
                    assert store.turns[event.turn_id].end_reason in (
                        TurnEndReason.CANCELLED,
                        TurnEndReason.JOINED,
                    )
        assert not running
        # Acceptance order: each group of queued turns started in the order it was queued,
        # INTERRUPTs before the others whenever both waited at once.
        for priority in (0, 1):
            group = [t for t in started if queued_order.get(t, (-1, 0))[0] == priority]
            assert group == sorted(group, key=lambda t: queued_order[t][1])
        messages = store.messages[session_id]
        calls = [m.tool_call_id for m in messages if m.kind is MessageKind.TOOL_CALL]
        results = [m.tool_call_id for m in messages if m.kind is MessageKind.TOOL_RESULT]
        assert sorted(calls) == sorted(results), "a tool call without exactly one result"
        assert len(set(results)) == len(results)
    for request_id, (turn_id, _on_busy) in world.acknowledged.items():
        turn = store.turns[turn_id]
        assert turn.state is TurnState.ENDED
        if turn.end_reason is TurnEndReason.JOINED:
            # Answered by the turn it joined: its message is that turn's, once.
            joined = [
                m
                for m in store.messages[turn.session_id]
                if m.kind is MessageKind.HUMAN and m.text == world.texts[request_id]
            ]
            assert len(joined) == 1 and joined[0].turn_id != turn_id
            continue
        human = [
            m
            for m in store.messages[turn.session_id]
            if m.kind is MessageKind.HUMAN and m.turn_id == turn_id
        ]
        if human:
            # Its own message first; any after it joined it (JOIN).
            assert human[0].text == world.texts[request_id]
            assert [m.text for m in human].count(world.texts[request_id]) == 1
        else:
            assert turn.end_reason is TurnEndReason.CANCELLED, f"{request_id} was lost"
    assert not store.queued, "a queued turn kept its message"
    per_request: dict[tuple[str, str], int] = defaultdict(int)
    for turn in store.turns.values():
        per_request[(turn.session_id, turn.request_id)] += 1
    assert max(per_request.values()) == 1


@pytest.mark.parametrize("number", SEEDS)
async def test_random_senders_strategies_cancels_and_kills_keep_the_invariants(
    number: int,
) -> None:
    world = await _drive(number)
    _check(world)
    assert len(world.acknowledged) > 20
    strategies = {on_busy for _turn, on_busy in world.acknowledged.values()}
    assert OnBusy.ENQUEUE in strategies and OnBusy.INTERRUPT in strategies
    ended = {t.end_reason for t in world.store.turns.values()}
    assert TurnEndReason.INTERRUPTED_BY_MESSAGE in ended and TurnEndReason.JOINED in ended
    queued = [e for es in world.store.events.values() for e in es if e.data is not None]
    assert sum(e.kind is EventKind.MESSAGE_QUEUED for e in queued) > 20
