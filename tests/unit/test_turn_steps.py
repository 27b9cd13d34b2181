"""The turn as a sequence of steps (docs/spec/turn-loop.md; decision 0110).

``TurnService(on_step=...)`` reports every step each turn takes; these tests pin the
sequences the step machine goes through for each way a turn can end, with in-memory
fakes (no I/O), and the planner's own identity of tool calls whatever ids the provider
gives.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from service.core.errors import ModelFailure, ToolFailure, Unavailable
from service.core.fanout import Hub
from service.core.model import MessageKind, Session, TurnEndReason
from service.core.ports import Acting, FinishReason, ModelRequest, ProjectInfo, Purpose, Role
from service.core.tools import ToolRunner, declarations
from service.core.turn import (
    End,
    NullObserver,
    SendRequest,
    Step,
    TurnDependencies,
    TurnService,
    TurnSettings,
)
from tests.memory_store import MemoryStore
from tests.unit.fakes import FakeBackends, FakeClock, ScriptedGateway, last_role


@dataclass
class StepRig:
    service: TurnService
    store: MemoryStore
    gateway: ScriptedGateway
    backends: FakeBackends
    steps: dict[str, list[Step]] = field(default_factory=dict)

    async def run(self, text: str) -> str:
        session = await self.store.get_session("s1")
        assert session is not None
        accepted = await self.service.send_message(
            SendRequest(session, "alice", "acme", "token", text, f"r-{len(self.store.turns)}")
        )
        await self.service.wait_for_end(accepted.turn.turn_id)
        return accepted.turn.turn_id

    def names(self, turn_id: str) -> list[str]:
        return [type(step).__name__ for step in self.steps[turn_id]]

    def end(self, turn_id: str) -> End:
        last = self.steps[turn_id][-1]
        assert isinstance(last, End)
        return last


class ProjectDown(FakeBackends):
    """Backends whose tracker cannot read the project."""

    async def get_project(self, acting: Acting, project_id: str, timeout_s: float) -> ProjectInfo:
        raise Unavailable("the tracker is down", reason="DEPENDENCY_UNAVAILABLE")


def make(
    script: Callable[[ModelRequest], dict[str, Any]],
    backends: FakeBackends | None = None,
    observer: NullObserver | None = None,
    **settings: Any,
) -> StepRig:
    store = MemoryStore()
    clock = FakeClock()
    store.add_session(Session("s1", "demo", "acme", "alice", "t", clock.now(), clock.now()))
    gateway = ScriptedGateway(script)
    backends = backends or FakeBackends()
    steps: dict[str, list[Step]] = {}
    service = TurnService(
        TurnDependencies(
            store=store,
            gateway=gateway,
            backends=backends,
            hub=Hub(store.events_after),
            clock=clock,
            settings=TurnSettings(**{"model": "m", "max_rounds": 2, **settings}),
            replica_id="r1",
            tools=ToolRunner(backends),
            declarations=declarations(),
            observer=observer or NullObserver(),
        ),
        on_step=lambda turn_id, step: steps.setdefault(turn_id, []).append(step),
    )
    return StepRig(service, store, gateway, backends, steps)


def tool_then_text(request: ModelRequest) -> dict[str, Any]:
    if last_role(request) is Role.USER:
        return {"tool_calls": [("get_item", '{"item_id": "PAN-1"}')]}
    return {"text": "done"}


async def test_a_one_round_turn_goes_through_each_step_once() -> None:
    rig = make(tool_then_text)
    turn_id = await rig.run("go")
    assert rig.names(turn_id) == [
        "Prepare", "Compact", "CallModel", "RunTools", "Compact", "CallModel", "End"
    ]  # fmt: skip
    assert rig.end(turn_id).ending.reason is TurnEndReason.COMPLETED


async def test_max_rounds_ends_before_a_model_call_would_start_another_round() -> None:
    rig = make(lambda r: {"tool_calls": [("list_runnable", "{}")]}, max_rounds=2)
    turn_id = await rig.run("go")
    assert rig.names(turn_id) == [
        "Prepare", "Compact", "CallModel", "RunTools",
        "Compact", "CallModel", "RunTools", "End",
    ]  # fmt: skip
    assert rig.end(turn_id).ending.reason is TurnEndReason.MAX_ROUNDS
    assert len(rig.gateway.requests) == 2


async def test_a_project_that_cannot_be_read_ends_the_turn_before_any_model_call() -> None:
    rig = make(tool_then_text, ProjectDown())
    turn_id = await rig.run("go")
    assert rig.names(turn_id) == ["Prepare", "End"]
    assert rig.end(turn_id).ending.error_reason == "DEPENDENCY_UNAVAILABLE"
    assert rig.gateway.requests == []


async def test_a_model_failure_ends_the_turn_from_the_model_step() -> None:
    rig = make(lambda r: {"error": ModelFailure("MODEL_UNAVAILABLE", "down")})
    turn_id = await rig.run("go")
    assert rig.names(turn_id) == ["Prepare", "Compact", "CallModel", "End"]
    assert rig.end(turn_id).ending.error_reason == "MODEL_UNAVAILABLE"


async def test_an_expired_credential_ends_the_turn_at_the_end_of_its_round() -> None:
    rig = make(tool_then_text)
    rig.backends.failures["get_item"] = ToolFailure("CREDENTIAL_EXPIRED", "expired")
    turn_id = await rig.run("go")
    assert rig.names(turn_id)[-2:] == ["RunTools", "End"]
    assert rig.end(turn_id).ending.error_reason == "CREDENTIAL_EXPIRED"


async def test_a_cancel_while_tools_run_ends_at_the_gate_after_the_round() -> None:
    rig = make(tool_then_text)
    release = asyncio.Event()
    rig.backends.block["get_item"] = release
    session = await rig.store.get_session("s1")
    assert session is not None
    accepted = await rig.service.send_message(
        SendRequest(session, "alice", "acme", "token", "go", "r-cancel")
    )
    turn_id = accepted.turn.turn_id
    await rig.backends.reached("get_item").wait()
    turn = await rig.service.cancel(session, turn_id)
    assert turn.end_reason is TurnEndReason.CANCELLED
    assert rig.names(turn_id) == ["Prepare", "Compact", "CallModel", "RunTools", "End"]
    release.set()


@pytest.mark.parametrize("finish", [FinishReason.LENGTH, FinishReason.CONTENT_FILTER])
async def test_an_answer_cut_by_the_provider_is_stored_cut_with_its_reason(
    finish: FinishReason,
) -> None:
    rig = make(lambda r: {"chunks": ["Half an ", "answer"], "finish": finish})
    turn_id = await rig.run("go")
    # At its output limit the turn says so (decision 0291); a filtered answer completes.
    expected = (
        TurnEndReason.OUTPUT_LIMIT if finish is FinishReason.LENGTH else TurnEndReason.COMPLETED
    )
    assert rig.end(turn_id).ending.reason is expected
    answer = [m for m in rig.store.messages["s1"] if m.kind is MessageKind.ASSISTANT][-1]
    assert answer.cut and answer.finish_reason == finish.value
    assert answer.text == "Half an answer"


@pytest.mark.parametrize("ids", [["call_0", "call_0"], ["0", "0"], ["", ""]])
async def test_each_call_gets_the_planners_own_id_whatever_the_provider_gave(
    ids: list[str],
) -> None:
    def script(request: ModelRequest) -> dict[str, Any]:
        if last_role(request) is Role.USER:
            return {
                "tool_calls": [
                    ("get_item", '{"item_id": "PAN-1"}'),
                    ("get_item", '{"item_id": "PAN-2"}'),
                ],
                "ids": ids,
            }
        return {"text": "done"}

    rig = make(script)
    await rig.run("one")
    await rig.run("two")
    stored = rig.store.messages["s1"]
    calls = [m for m in stored if m.kind is MessageKind.TOOL_CALL]
    assert len({m.tool_call_id for m in calls}) == 4
    assert [m.provider_call_id for m in calls] == ids + ids
    # Reads carry no request id (ToolBackends is typed per RPC; only writes send one, and
    # it is the planner's id: tests/unit/test_tools.py); the provider's never reaches them.
    assert len(rig.backends.calls) == 4
    assert {c.request_id for c in rig.backends.calls} == {""}
    # Each request pairs every call with its own result, under ids unique per answer.
    last = rig.gateway.requests[-1]
    for index, message in enumerate(last.messages):
        if message.role is Role.ASSISTANT and message.tool_calls:
            wire = [call.call_id for call in message.tool_calls]
            assert len(set(wire)) == len(wire)
            results = last.messages[index + 1 : index + 1 + len(wire)]
            assert [r.tool_call_id for r in results] == wire
            for call, result in zip(message.tool_calls, results, strict=True):
                item = json.loads(call.arguments)["item_id"]
                assert item in result.text


async def test_the_request_speaks_to_the_provider_with_its_own_ids() -> None:
    def script(request: ModelRequest) -> dict[str, Any]:
        if request.purpose is Purpose.TURN and last_role(request) is Role.USER:
            return {"tool_calls": [("get_item", '{"item_id": "PAN-1"}')], "ids": ["toolu_A1"]}
        return {"text": "done"}

    rig = make(script)
    await rig.run("one")
    second = rig.gateway.requests[1]
    assert second.messages[1].tool_calls[0].call_id == "toolu_A1"
    assert second.messages[2].tool_call_id == "toolu_A1"
