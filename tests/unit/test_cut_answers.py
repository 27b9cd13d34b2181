"""Answers cut at the output limit keep what is whole, and exact repeats within one answer
run once (decision 0292; docs/spec/turn-loop.md, "Tool calls"), on the turn loop with a
scripted model."""

from __future__ import annotations

import json
from typing import Any

from service.core.model import MessageKind, TurnEndReason
from service.core.ports import FinishReason, ModelRequest, Role
from tests.unit.fakes import last_role
from tests.unit.test_turn_steps import make

PAN_1 = '{"item_id": "PAN-1"}'
CUT = '{"item_id": "PA'


def results_by_call(rig: Any) -> dict[str, Any]:
    return {
        m.tool_call_id: m for m in rig.store.messages["s1"] if m.kind is MessageKind.TOOL_RESULT
    }


def calls_stored(rig: Any) -> list[Any]:
    return [m for m in rig.store.messages["s1"] if m.kind is MessageKind.TOOL_CALL]


async def test_complete_repeated_calls_at_length_run_once_and_the_cut_call_gets_an_error() -> None:
    def script(request: ModelRequest) -> dict[str, Any]:
        if last_role(request) is Role.USER:
            return {
                "tool_calls": [
                    ("get_item", PAN_1),
                    ("get_item", '{ "item_id" : "PAN-1" }'),  # the same call, spaced
                    ("list_runnable", "{}"),
                    ("get_item", PAN_1),
                    ("get_item", CUT),
                ],
                "finish": FinishReason.LENGTH,
            }
        return {"text": "PAN-1 is open."}

    rig = make(script)
    turn_id = await rig.run("go")
    assert rig.end(turn_id).ending.reason is TurnEndReason.COMPLETED
    # Each distinct complete call ran once.
    assert sorted(call.tool for call in rig.backends.calls) == ["get_item", "list_runnable"]
    calls, results = calls_stored(rig), results_by_call(rig)
    assert len(calls) == 5 and set(results) == {c.tool_call_id for c in calls}
    first, *repeats = (results[calls[i].tool_call_id] for i in (0, 1, 3))
    assert not first.tool_error and all(r.tool_result == first.tool_result for r in repeats)
    cut = results[calls[4].tool_call_id]
    assert cut.tool_error and "CUT_AT_OUTPUT_LIMIT" in cut.tool_result
    assert "output limit" in cut.tool_result
    # The cut call's arguments are kept as valid JSON, marked cut.
    assert calls[4].cut and json.loads(calls[4].tool_arguments)["content"] == CUT
    # The round counted and the turn went on: the model saw every result.
    assert len(rig.gateway.requests) == 2
    tools = [m for m in rig.gateway.requests[1].messages if m.role is Role.TOOL]
    assert len(tools) == 5


async def test_a_repeated_write_gets_an_error_result_naming_the_call_it_repeats() -> None:
    proposal = json.dumps(
        {"title": "t", "operations": [{"create_item": {"kind": "ticket", "title": "x"}}]}
    )

    def script(request: ModelRequest) -> dict[str, Any]:
        if last_role(request) is Role.USER:
            return {"tool_calls": [("propose_changeset", proposal)] * 2}
        return {"text": "proposed"}

    rig = make(script)
    turn_id = await rig.run("go")
    assert rig.end(turn_id).ending.reason is TurnEndReason.COMPLETED
    assert [call.tool for call in rig.backends.calls] == ["propose_changeset"]
    kinds = [m.kind for m in rig.store.messages["s1"]]
    assert kinds.count(MessageKind.TOOL_RESULT) == 2
    events = [e.kind.value for e in rig.store.events["s1"]]
    assert events.count("changeset_proposed") == 1
    calls, results = calls_stored(rig), results_by_call(rig)
    repeat = results[calls[1].tool_call_id]
    assert repeat.tool_error and "REPEATED_CALL" in repeat.tool_result
    assert calls[0].tool_call_id in repeat.tool_result


async def test_a_second_cut_answer_ends_the_turn_with_its_own_reason() -> None:
    def script(request: ModelRequest) -> dict[str, Any]:
        return {
            "tool_calls": [("list_runnable", "{}"), ("get_item", CUT)],
            "finish": FinishReason.LENGTH,
        }

    rig = make(script, max_rounds=5)
    turn_id = await rig.run("go")
    end = rig.end(turn_id)
    assert end.ending.reason is TurnEndReason.OUTPUT_LIMIT
    assert end.ending.error_reason == "OUTPUT_LIMIT_CUT_CALLS"
    # Both answers' complete calls ran; no third model call was made.
    assert len(rig.gateway.requests) == 2
    assert [call.tool for call in rig.backends.calls] == ["list_runnable"] * 2


async def test_a_call_cut_alone_is_answered_and_the_turn_goes_on() -> None:
    def script(request: ModelRequest) -> dict[str, Any]:
        if last_role(request) is Role.USER:
            return {"text": "Let me look", "tool_calls": [("get_item", CUT)], "finish": "length"}
        return {"text": "Sorry, here it is."}

    rig = make(lambda r: {**script(r), "finish": FinishReason(script(r).get("finish", "stop"))})
    turn_id = await rig.run("go")
    assert rig.end(turn_id).ending.reason is TurnEndReason.COMPLETED
    assert rig.backends.calls == []
    (result,) = results_by_call(rig).values()
    assert result.tool_error and "CUT_AT_OUTPUT_LIMIT" in result.tool_result
