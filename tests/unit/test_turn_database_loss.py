"""A run whose commit fails because the database is gone (decision 0070): it stops its
tool calls at once and closes its own turn FAILED/DATABASE_UNAVAILABLE as soon as the
database answers again, from what is stored, instead of leaving it RUNNING (and the
session blocked) until its lease expires.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

from service.core.model import MessageKind, TurnEndReason, TurnState
from service.core.ports import ModelRequest, Role
from tests.unit.fakes import FakeBackends, last_role
from tests.unit.test_turn import make_rig


def note_cancelled(backends: FakeBackends) -> tuple[list[str], asyncio.Event]:
    """The tools whose call ``backends`` saw cancelled mid-flight, and an event set on the
    first."""
    return backends.cancelled, backends.cancel_seen


def read_and_write(request: ModelRequest) -> dict[str, Any]:
    if last_role(request) is Role.USER:
        return {
            "tool_calls": [
                ("get_item", '{"item_id":"a"}'),
                ("create_knowledge", '{"kind":"note","title":"t","body":"b"}'),
            ]
        }
    return {"text": "done"}


async def test_a_failed_commit_stops_the_tools_and_ends_the_turn_when_the_store_answers() -> None:
    rig = make_rig(read_and_write)
    cancelled, cancel_seen = note_cancelled(rig.backends)
    read, write = asyncio.Event(), asyncio.Event()
    rig.backends.block.update(get_item=read, create_knowledge=write)
    turn_id = await rig.send("go")
    await rig.backends.reached("get_item").wait()
    await rig.backends.reached("create_knowledge").wait()

    rig.store.fail = True
    read.set()  # the read's result cannot be stored: the run gives up on storing
    await asyncio.wait_for(cancel_seen.wait(), 5)
    assert cancelled == ["create_knowledge"]
    assert rig.store.turns[turn_id].state is TurnState.RUNNING

    rig.store.fail = False
    turn = await asyncio.wait_for(rig.service.wait_for_end(turn_id), 5)
    assert turn.end_reason is TurnEndReason.FAILED
    assert turn.error_reason == "DATABASE_UNAVAILABLE"
    assert turn.rounds == 1
    messages = rig.store.messages["s1"]
    calls = [m for m in messages if m.kind is MessageKind.TOOL_CALL]
    results = {m.tool_call_id: m for m in messages if m.kind is MessageKind.TOOL_RESULT}
    assert {c.tool_call_id for c in calls} == set(results)
    unknown = results[calls[1].tool_call_id]
    assert unknown.tool_error
    assert "outcome is unknown" in json.loads(unknown.tool_result)["error"]["message"]
    assert rig.service.running == 0

    # The session is free at once (no lease to wait out); the next turn pairs every call.
    write.set()
    next_turn = await rig.run("again")
    assert rig.store.turns[next_turn].end_reason is TurnEndReason.COMPLETED
    request = rig.gateway.requests[-1]
    paired = [m.tool_call_id for m in request.messages if m.role is Role.TOOL]
    assert paired == [c.call_id for m in request.messages for c in m.tool_calls]


async def test_a_turn_another_replica_closed_is_left_alone() -> None:
    rig = make_rig(read_and_write)
    read = asyncio.Event()
    rig.backends.block["get_item"] = read
    rig.backends.block["create_knowledge"] = asyncio.Event()
    turn_id = await rig.send("go")
    await rig.backends.reached("get_item").wait()
    # A sweeper elsewhere closed the turn: the run's next commit conflicts.
    rig.store.turns[turn_id] = replace(
        rig.store.turns[turn_id], state=TurnState.ENDED, end_reason=TurnEndReason.INTERRUPTED
    )
    before = len(rig.store.events["s1"])
    read.set()
    turn = await asyncio.wait_for(rig.service.wait_for_end(turn_id), 5)
    assert turn.end_reason is TurnEndReason.INTERRUPTED
    assert len(rig.store.events["s1"]) == before


def one_answer(rig_box: list[Any]) -> Any:
    """A model that answers at once and, as it answers, cuts the store (the database goes
    silent while the answer streams)."""

    def script(request: ModelRequest) -> dict[str, Any]:
        rig_box[0].store.fail = True
        return {"text": "the answer the human saw"}

    return script


async def test_an_answer_streamed_while_the_store_was_gone_is_kept_when_it_answers() -> None:
    """Decision 0311: the owner's ending is fenced by ownership, not by the lease's clock;
    nobody else took the turn, so the answer is stored and the turn COMPLETED."""
    box: list[Any] = []
    rig = make_rig(one_answer(box))
    box.append(rig)
    turn_id = await rig.send("go")
    await asyncio.wait_for(rig.store.failed.wait(), 5)
    assert rig.store.turns[turn_id].state is TurnState.RUNNING
    # Long past the lease (the store cannot tell the owner so): nobody else ended it.
    rig.clock.advance(600)
    rig.store.fail = False
    turn = await asyncio.wait_for(rig.service.wait_for_end(turn_id), 5)
    assert turn.end_reason is TurnEndReason.COMPLETED
    answers = [m for m in rig.store.messages["s1"] if m.kind is MessageKind.ASSISTANT]
    assert [m.text for m in answers] == ["the answer the human saw"]


async def test_an_answer_whose_turn_another_replica_ended_is_refused() -> None:
    box: list[Any] = []
    rig = make_rig(one_answer(box))
    box.append(rig)
    turn_id = await rig.send("go")
    await asyncio.wait_for(rig.store.failed.wait(), 5)
    # Another replica's sweeper closed it meanwhile.
    rig.store.turns[turn_id] = replace(
        rig.store.turns[turn_id], state=TurnState.ENDED, end_reason=TurnEndReason.INTERRUPTED
    )
    before = len(rig.store.events["s1"])
    rig.store.fail = False
    turn = await asyncio.wait_for(rig.service.wait_for_end(turn_id), 5)
    assert turn.end_reason is TurnEndReason.INTERRUPTED
    assert len(rig.store.events["s1"]) == before
