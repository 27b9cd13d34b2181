"""The turn loop with in-memory fakes: rounds, limits, cancel, compaction, recovery.

The service tier runs the same behaviours on the devstack over gRPC; here each rule of
docs/spec/turn-loop.md and docs/spec/compaction.md is pinned quickly and deterministically.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from typing import Any

import pytest

from service.core import prompts
from service.core.context import SUMMARY_TAG, to_model_messages
from service.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    ModelFailure,
    StoreUnavailable,
    ToolFailure,
)
from service.core.estimate import message_tokens
from service.core.fanout import Hub
from service.core.model import (
    CompactedData,
    EventKind,
    MessageKind,
    OnBusy,
    Session,
    SessionEvent,
    TurnEndReason,
    TurnState,
)
from service.core.ports import ModelRequest, Purpose, Role, SkillDocument
from service.core.tools import ToolRunner, declarations
from service.core.turn import (
    NullObserver,
    SendRequest,
    TurnDependencies,
    TurnObserver,
    TurnService,
    TurnSettings,
)
from service.core.turn.service import Accepted
from tests.memory_store import MemoryStore
from tests.unit.fakes import (
    FakeBackends,
    FakeClock,
    ScriptedGateway,
    last_role,
    tool_results_in_turn,
)


@dataclass
class Rig:
    service: TurnService
    store: MemoryStore
    gateway: ScriptedGateway
    backends: FakeBackends
    hub: Hub
    clock: FakeClock
    session: Session

    async def send(self, text: str, request_id: str = "") -> str:
        return (await self.accept(text, request_id)).turn.turn_id

    async def accept(
        self, text: str, request_id: str = "", on_busy: OnBusy = OnBusy.REJECT
    ) -> Accepted:
        """Send ``text`` as alice; what the service answered (decision 0300 for
        ``on_busy``)."""
        session = await self.store.get_session(self.session.session_id)
        assert session is not None
        return await self.service.send_message(
            SendRequest(
                session=session,
                human_id="alice",
                organization_id="acme",
                token="token-alice",
                text=text,
                request_id=request_id or f"req-{len(self.store.turns)}-{text[:8]}",
                on_busy=on_busy,
            )
        )

    async def run(self, text: str) -> str:
        turn_id = await self.send(text)
        await self.service.wait_for_end(turn_id)
        return turn_id

    def kinds(self) -> list[EventKind]:
        return [e.kind for e in self.store.events[self.session.session_id]]


def make_rig(script: Any, *, observer: TurnObserver | None = None, **settings: Any) -> Rig:
    """The turn service over the fakes; ``observer`` records its metrics hooks."""
    store = MemoryStore()
    clock = FakeClock()
    session = store.add_session(
        Session(
            session_id="s1",
            project_id="demo",
            organization_id="acme",
            owner_id="alice",
            title="t",
            create_time=clock.now(),
            update_time=clock.now(),
        )
    )
    gateway = ScriptedGateway(script)
    backends = FakeBackends()
    hub = Hub(store.events_after)
    defaults: dict[str, Any] = {"model": "test-model", "max_rounds": 4}
    defaults.update(settings)
    service = TurnService(
        TurnDependencies(
            store=store,
            gateway=gateway,
            backends=backends,
            hub=hub,
            clock=clock,
            settings=TurnSettings(**defaults),
            replica_id="r1",
            tools=ToolRunner(backends),
            declarations=declarations(),
            observer=observer or NullObserver(),
        )
    )
    return Rig(service, store, gateway, backends, hub, clock, session)


def one_round(request: ModelRequest) -> dict[str, Any]:
    if request.purpose is Purpose.COMPACTION:
        return {"text": "SUMMARY", "usage": (100, 10)}
    if last_role(request) is Role.USER:
        return {"tool_calls": [("list_items", '{"kind":"epic"}')], "usage": (1000, 20)}
    return {"chunks": ["Here ", "they ", "are."], "usage": (1200, 30)}


async def test_one_round_turn_makes_three_commits_and_two_model_calls() -> None:
    # Three: the message with the turn; the answer, its read call and the call's result
    # (decision 0114: a round of reads is stored with its first result); the final
    # answer with the end. docs/performance.md (T1) allows four; decision 0114 makes it three.
    rig = make_rig(one_round)
    turn_id = await rig.run("list the epics")
    turn = rig.store.turns[turn_id]
    assert turn.state is TurnState.ENDED and turn.end_reason is TurnEndReason.COMPLETED
    assert turn.rounds == 1
    assert rig.store.commits == 3
    assert len(rig.gateway.requests) == 2
    assert len(rig.backends.calls) == 1
    assert rig.backends.project_reads == 1
    assert rig.kinds() == [
        EventKind.MESSAGE_ACCEPTED,
        EventKind.TURN_STARTED,
        EventKind.TOOL_CALL_STARTED,
        EventKind.TOOL_CALL_FINISHED,
        EventKind.ASSISTANT_MESSAGE,
        EventKind.TURN_ENDED,
    ]
    sequences = [e.sequence for e in rig.store.events["s1"]]
    assert sequences == list(range(1, len(sequences) + 1))
    second = rig.gateway.requests[1]
    assert [m.role for m in second.messages] == [Role.USER, Role.ASSISTANT, Role.TOOL]
    assert second.messages[2].tool_call_id == second.messages[1].tool_calls[0].call_id
    assert turn.usage.input_tokens == 2200
    assert turn.tool_schema_version and turn.instructions_version == prompts.INSTRUCTIONS_VERSION


async def test_the_backend_call_acts_for_the_human_in_the_sessions_project() -> None:
    rig = make_rig(one_round)
    await rig.run("list the epics")
    call = rig.backends.calls[0]
    assert call.project_id == "demo"
    assert call.acting.human_id == "alice" and call.acting.actor == "planner:s1"
    assert call.request_id == "", "a read carries no request id; writes carry the call's"


async def test_second_turn_reuses_the_cached_project_and_skill() -> None:
    rig = make_rig(one_round)
    rig.backends.skill = SkillDocument("demo-planning", "1.0.0", "Always estimate.")
    await rig.run("one")
    await rig.run("two")
    assert rig.backends.project_reads == 1 and rig.backends.skill_reads == 1
    system = rig.gateway.requests[0].system_context
    assert "Always estimate." in system and "version 1.0.0" in system and "Acme" in system
    assert rig.store.turns[next(iter(rig.store.turns))].skill_version == "1.0.0"


async def test_later_turns_reuse_the_earlier_turns_conversation() -> None:
    # Decisions 0115 and 0392: the model's messages of ended turns are converted once per
    # session, so the next turn's requests carry the very same objects (the gateway
    # client keeps their encodings by identity).
    rig = make_rig(one_round)
    for text in ("one", "two", "three"):
        await rig.run(text)
    second, third = rig.gateway.requests[2].messages, rig.gateway.requests[4].messages
    turn_one = 4  # its question, the answer with its call, the result, the final answer
    assert [m.role for m in second[:turn_one]] == [
        Role.USER,
        Role.ASSISTANT,
        Role.TOOL,
        Role.ASSISTANT,
    ]
    assert all(a is b for a, b in zip(second[:turn_one], third[:turn_one], strict=True))
    # Within a turn, both calls share the earlier turns too.
    fourth = rig.gateway.requests[5].messages
    assert all(a is b for a, b in zip(third[: turn_one + 4], fourth, strict=False))


async def test_max_rounds_stops_without_another_model_call_and_the_next_turn_continues() -> None:
    rig = make_rig(
        lambda r: {"tool_calls": [("list_runnable", "{}")], "usage": (10, 1)}, max_rounds=3
    )
    first = await rig.run("go")
    turn = rig.store.turns[first]
    assert turn.end_reason is TurnEndReason.MAX_ROUNDS and turn.rounds == 3
    assert len(rig.gateway.requests) == 3
    await rig.run("continue")
    assert len(rig.gateway.requests) == 6
    fourth = rig.gateway.requests[3]
    assert sum(1 for m in fourth.messages if m.role is Role.TOOL) == 3
    assert fourth.messages[-1].text == "continue"


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        ("{not json", "INVALID_ARGUMENTS"),
        ('{"kind": "galaxy"}', "INVALID_ARGUMENTS"),
        ('{"kind": "epic", "colour": "red"}', "INVALID_ARGUMENTS"),
    ],
)
async def test_bad_arguments_become_error_results_and_the_turn_completes(
    arguments: str, reason: str
) -> None:
    rig = make_rig(
        lambda r: (
            {"tool_calls": [("list_items", arguments)]}
            if last_role(r) is Role.USER
            else {"text": "sorry"}
        )
    )
    turn_id = await rig.run("go")
    assert rig.store.turns[turn_id].end_reason is TurnEndReason.COMPLETED
    result = rig.gateway.requests[1].messages[-1]
    assert result.role is Role.TOOL and result.is_error
    assert json.loads(result.text)["error"]["reason"] == reason
    assert rig.backends.calls == []


async def test_unknown_tool_and_backend_failure_are_error_results() -> None:
    rig = make_rig(
        lambda r: (
            {"tool_calls": [("launch_rocket", "{}"), ("get_item", '{"item_id": "x"}')]}
            if last_role(r) is Role.USER
            else {"text": "done"}
        )
    )
    rig.backends.failures["get_item"] = ToolFailure("NOT_FOUND", "no item x")
    await rig.run("go")
    tools = [m for m in rig.gateway.requests[1].messages if m.role is Role.TOOL]
    reasons = [json.loads(m.text)["error"]["reason"] for m in tools]
    assert reasons == ["UNKNOWN_TOOL", "NOT_FOUND"]


async def test_calls_beyond_the_per_answer_cap_are_refused_but_still_answered() -> None:
    # Five different calls (an exact repeat would share its first call's result).
    calls = [("get_item", json.dumps({"item_id": f"PAN-{i}"})) for i in range(5)]
    rig = make_rig(
        lambda r: {"tool_calls": calls} if last_role(r) is Role.USER else {"text": "ok"},
        max_tool_calls_per_answer=2,
    )
    await rig.run("go")
    tools = [m for m in rig.gateway.requests[1].messages if m.role is Role.TOOL]
    assert len(tools) == 5
    assert sum(1 for m in tools if m.is_error) == 3
    assert len(rig.backends.calls) == 2


async def test_write_cap_gives_an_error_result() -> None:
    proposals = [
        json.dumps(
            {"title": f"t{i}", "operations": [{"create_item": {"kind": "ticket", "title": "x"}}]}
        )
        for i in range(3)
    ]
    rig = make_rig(
        lambda r: (
            {"tool_calls": [("propose_changeset", proposal) for proposal in proposals]}
            if last_role(r) is Role.USER
            else {"text": "ok"}
        ),
        max_writes_per_turn=2,
    )
    turn_id = await rig.run("go")
    kinds = rig.kinds()
    assert kinds.count(EventKind.CHANGESET_PROPOSED) == 2
    assert rig.store.turns[turn_id].writes == 2
    tools = [m for m in rig.gateway.requests[1].messages if m.role is Role.TOOL]
    assert sum(1 for m in tools if m.is_error) == 1


async def test_model_failure_after_deltas_keeps_the_cut_text_and_fails_the_turn() -> None:
    rig = make_rig(
        lambda r: {
            "chunks": ["partial ", "answer"],
            "error": ModelFailure("MODEL_UNAVAILABLE", "gone"),
            "error_after": 1,
        }
    )
    turn_id = await rig.run("go")
    turn = rig.store.turns[turn_id]
    assert turn.end_reason is TurnEndReason.FAILED and turn.error_reason == "MODEL_UNAVAILABLE"
    assistant = [m for m in rig.store.messages["s1"] if m.kind is MessageKind.ASSISTANT]
    assert assistant[0].text == "partial " and assistant[0].cut


async def test_cancel_during_text_stores_the_partial_answer_cut() -> None:
    release = asyncio.Event()
    rig = make_rig(lambda r: {"chunks": ["Hello"], "block": release})
    turn_id = await rig.send("go")
    await rig.gateway.started.wait()
    session = await rig.store.get_session("s1")
    assert session is not None
    turn = await rig.service.cancel(session, turn_id)
    assert turn.end_reason is TurnEndReason.CANCELLED
    assistant = [m for m in rig.store.messages["s1"] if m.kind is MessageKind.ASSISTANT]
    assert assistant[0].text == "Hello" and assistant[0].cut


async def test_cancel_during_parallel_tools_answers_every_call() -> None:
    rig = make_rig(
        lambda r: (
            {"tool_calls": [("list_runnable", "{}"), ("get_item", '{"item_id":"a"}')]}
            if last_role(r) is Role.USER
            else {"text": "after"}
        )
    )
    blocker = asyncio.Event()
    rig.backends.block["get_item"] = blocker
    turn_id = await rig.send("go")
    await rig.backends.reached("get_item").wait()
    session = await rig.store.get_session("s1")
    assert session is not None
    turn = await rig.service.cancel(session, turn_id)
    assert turn.end_reason is TurnEndReason.CANCELLED
    calls = [m for m in rig.store.messages["s1"] if m.kind is MessageKind.TOOL_CALL]
    results = {
        m.tool_call_id: m for m in rig.store.messages["s1"] if m.kind is MessageKind.TOOL_RESULT
    }
    assert {c.tool_call_id for c in calls} == set(results)
    cancelled = results[calls[1].tool_call_id]
    assert json.loads(cancelled.tool_result)["error"]["reason"] == "CANCELLED"
    del rig.backends.block["get_item"]
    await rig.run("next")
    request = rig.gateway.requests[-1]
    paired = [m.tool_call_id for m in request.messages if m.role is Role.TOOL]
    assert paired == [c.call_id for m in request.messages for c in m.tool_calls]


async def test_cancelling_an_ended_turn_changes_nothing() -> None:
    rig = make_rig(one_round)
    turn_id = await rig.run("go")
    session = await rig.store.get_session("s1")
    assert session is not None
    before = len(rig.store.events["s1"])
    turn = await rig.service.cancel(session, turn_id)
    assert turn.end_reason is TurnEndReason.COMPLETED
    assert len(rig.store.events["s1"]) == before


async def test_duplicate_request_id_returns_the_original_and_stores_nothing() -> None:
    rig = make_rig(one_round)
    first = await rig.send("hello", request_id="r-1")
    await rig.service.wait_for_end(first)
    count = len(rig.store.events["s1"])
    session = await rig.store.get_session("s1")
    assert session is not None
    again = await rig.service.send_message(
        SendRequest(session, "alice", "acme", "t", "hello", "r-1")
    )
    assert again.duplicate and again.turn.turn_id == first
    assert len(rig.store.events["s1"]) == count
    with pytest.raises(InvalidArgument) as error:
        await rig.service.send_message(SendRequest(session, "alice", "acme", "t", "other", "r-1"))
    assert error.value.reason == "REQUEST_ID_REUSED"


async def test_a_second_message_while_a_turn_runs_is_refused() -> None:
    release = asyncio.Event()
    rig = make_rig(lambda r: {"text": "slow", "block": release})
    turn_id = await rig.send("first")
    with pytest.raises(FailedPrecondition) as error:
        await rig.send("second")
    assert error.value.reason == "TURN_IN_PROGRESS"
    release.set()
    await rig.service.wait_for_end(turn_id)


def running_elsewhere(rig: Rig, like: str, turn_id: str, owner: str) -> None:
    """Store ``turn_id``, a copy of the ended turn ``like`` running on replica ``owner``
    whose lease expires now."""
    rig.store.turns[turn_id] = replace(
        rig.store.turns[like],
        turn_id=turn_id,
        state=TurnState.RUNNING,
        end_reason=None,
        owner=owner,
        request_id=turn_id,
        lease_expires_at=rig.clock.now(),
    )


async def test_expired_lease_is_swept_interrupted_with_outcome_unknown_results() -> None:
    rig = make_rig(one_round)
    turn_id = await rig.send("go")
    # Simulate a dead owner: another replica's running turn with a stored tool call.
    await rig.service.wait_for_end(turn_id)
    running_elsewhere(rig, turn_id, "turn_dead", "r-dead")
    call = replace(
        next(m for m in rig.store.messages["s1"] if m.kind is MessageKind.TOOL_CALL),
        turn_id="turn_dead",
        tool_call_id="call_dead",
        tool_name="propose_changeset",
        message_id="m-dead",
    )
    rig.store._append(
        "s1",
        [
            SessionEvent(
                "s1", "turn_dead", EventKind.TOOL_CALL_STARTED, rig.clock.now(), message=call
            )
        ],
        None,
    )
    rig.clock.advance(1)
    assert await rig.service.sweep() == 1
    ended = rig.store.turns["turn_dead"]
    assert ended.end_reason is TurnEndReason.INTERRUPTED
    result = [
        m
        for m in rig.store.messages["s1"]
        if m.tool_call_id == "call_dead" and m.kind is MessageKind.TOOL_RESULT
    ]
    assert "outcome is unknown" in json.loads(result[0].tool_result)["error"]["message"]


async def test_a_sweeper_back_from_its_own_outage_gives_the_owners_a_lease_first() -> None:
    # Every replica lost the database, so every lease expired meanwhile; the owners are
    # alive and renew, or store what their humans saw, once it answers (decision 0371).
    rig = make_rig(one_round, lease_s=15.0)
    turn_id = await rig.send("go")
    await rig.service.wait_for_end(turn_id)
    running_elsewhere(rig, turn_id, "turn_other", "r-other")
    rig.clock.advance(1)
    reachable = rig.store.running_turns

    async def unreachable(**_: Any) -> list[Any]:
        raise StoreUnavailable("the database did not answer")

    rig.store.running_turns = unreachable  # type: ignore[method-assign]
    with pytest.raises(StoreUnavailable):
        await rig.service.sweep()
    rig.store.running_turns = reachable  # type: ignore[method-assign]
    assert await rig.service.sweep() == 0
    rig.clock.advance(14)
    assert await rig.service.sweep() == 0
    assert rig.store.turns["turn_other"].state is TurnState.RUNNING
    # A lease after the answer, an owner that did not renew is gone: swept.
    rig.clock.advance(1.5)
    assert await rig.service.sweep() == 1
    assert rig.store.turns["turn_other"].end_reason is TurnEndReason.INTERRUPTED


# ---------------------------------------------------------------------- compaction


def compacting(threshold_usage: int) -> Any:
    def script(request: ModelRequest) -> dict[str, Any]:
        if request.purpose is Purpose.COMPACTION:
            return {"text": f"SUMMARY{len(request.system_prompt)}", "usage": (50, 7)}
        return {"text": "answer", "usage": (threshold_usage, 10)}

    return script


async def test_compaction_by_reported_usage_happens_once_and_shapes_the_context() -> None:
    rig = make_rig(compacting(900), compact_at_tokens=500)
    await rig.run("first")
    assert all(r.purpose is Purpose.TURN for r in rig.gateway.requests)
    await rig.run("second")
    purposes = [r.purpose for r in rig.gateway.requests]
    assert purposes == [Purpose.TURN, Purpose.COMPACTION, Purpose.TURN]
    compaction = rig.gateway.requests[1]
    assert "Human: first" in compaction.system_prompt and compaction.tools == ()
    assert "first" not in "".join(m.text for m in compaction.messages)
    after = rig.gateway.requests[2]
    summary = rig.store.sessions["s1"].summary
    assert f"<{SUMMARY_TAG}>\n{summary}\n</{SUMMARY_TAG}>" in after.system_context
    assert [m.text for m in after.messages] == ["second"]
    marker = [e for e in rig.store.events["s1"] if e.kind is EventKind.COMPACTED]
    assert len(marker) == 1
    first_answer = next(m for m in rig.store.messages["s1"] if m.kind is MessageKind.ASSISTANT)
    data = marker[0].data
    assert isinstance(data, CompactedData)
    # up_to is the last message before the current turn's human message; the estimate is
    # the reported usage (900 + 10) plus the estimate of the message "second".
    assert data.up_to == first_answer.sequence
    second = next(m for m in rig.store.messages["s1"] if m.text == "second")
    assert data.estimated_tokens == 910 + message_tokens(second)
    session = rig.store.sessions["s1"]
    assert session.summary.startswith("SUMMARY") and session.summary_up_to == first_answer.sequence


async def test_below_the_threshold_there_is_no_compaction() -> None:
    rig = make_rig(compacting(100), compact_at_tokens=500)
    await rig.run("first")
    await rig.run("second")
    assert all(r.purpose is Purpose.TURN for r in rig.gateway.requests)


async def test_compaction_by_character_estimate_without_usage() -> None:
    """No usage is reported: the fixed prompt (about 2,100 tokens) plus a 900-token
    answer is over 2,800, so the second turn compacts."""

    def script(request: ModelRequest) -> dict[str, Any]:
        if request.purpose is Purpose.COMPACTION:
            return {"text": "The human asked twice; the planner answered at length. " * 4}
        return {"text": "x" * 4000}

    rig = make_rig(script, compact_at_tokens=2800)
    await rig.run("first")
    assert [r.purpose for r in rig.gateway.requests].count(Purpose.COMPACTION) == 0
    await rig.run("second")
    assert [r.purpose for r in rig.gateway.requests].count(Purpose.COMPACTION) == 1
    assert EventKind.COMPACTED in rig.kinds()


async def test_second_compaction_folds_in_the_first_summary() -> None:
    rig = make_rig(compacting(900), compact_at_tokens=500)
    for text in ("one", "two", "three"):
        await rig.run(text)
    compactions = [r for r in rig.gateway.requests if r.purpose is Purpose.COMPACTION]
    assert len(compactions) == 2
    first_summary = "SUMMARY" + str(len(compactions[0].system_prompt))
    assert first_summary in compactions[1].system_prompt
    last = rig.gateway.requests[-1]
    assert rig.store.sessions["s1"].summary in last.system_context
    assert [m.text for m in last.messages] == ["three"]


async def test_only_the_current_turn_in_context_makes_no_compaction_call() -> None:
    rig = make_rig(
        lambda r: {"tool_calls": [("list_runnable", "{}")], "usage": (10_000, 1)},
        compact_at_tokens=10,
        max_rounds=3,
    )
    turn_id = await rig.run("first")
    assert rig.store.turns[turn_id].end_reason is TurnEndReason.MAX_ROUNDS
    assert all(r.purpose is Purpose.TURN for r in rig.gateway.requests)


async def test_compaction_never_separates_a_call_from_its_result() -> None:
    def script(request: ModelRequest) -> dict[str, Any]:
        if request.purpose is Purpose.COMPACTION:
            return {"text": "SUMMARY", "usage": (1, 1)}
        if tool_results_in_turn(request) < 2:
            return {
                "tool_calls": [("list_runnable", "{}"), ("list_skills", "{}")],
                "usage": (900, 1),
            }
        return {"text": "done", "usage": (900, 1)}

    rig = make_rig(script, compact_at_tokens=500)
    await rig.run("first")
    await rig.run("second")
    for request in rig.gateway.requests:
        if request.purpose is not Purpose.TURN:
            continue
        calls = [c.call_id for m in request.messages for c in m.tool_calls]
        results = [m.tool_call_id for m in request.messages if m.role is Role.TOOL]
        assert calls == results


@pytest.mark.parametrize(
    "reply",
    [
        {"error": ModelFailure("MODEL_UNAVAILABLE", "down")},
        {"error": ModelFailure("MODEL_TIMEOUT", "slow")},
        {"text": "   "},
        {"text": "Error: something broke"},
    ],
)
async def test_failed_compaction_changes_nothing_and_the_turn_completes(
    reply: dict[str, Any],
) -> None:
    def script(request: ModelRequest) -> dict[str, Any]:
        if request.purpose is Purpose.COMPACTION:
            return reply
        return {"text": "answer", "usage": (900, 10)}

    rig = make_rig(script, compact_at_tokens=500)
    await rig.run("first")
    turn_id = await rig.run("second")
    assert rig.store.turns[turn_id].end_reason is TurnEndReason.COMPLETED
    assert rig.store.sessions["s1"].summary == ""
    assert EventKind.COMPACTED not in rig.kinds()
    assert [r.purpose for r in rig.gateway.requests].count(Purpose.COMPACTION) == 1


def test_model_messages_list_results_in_call_order() -> None:
    rig = make_rig(one_round)
    now = rig.clock.now()
    from service.core.model import Message

    def msg(seq: int, kind: MessageKind, **kw: Any) -> Message:
        return Message("s1", "t", f"m{seq}", kind, now, sequence=seq, **kw)

    messages = [
        msg(1, MessageKind.HUMAN, text="hi"),
        msg(2, MessageKind.TOOL_CALL, tool_call_id="a", tool_name="x", tool_arguments="{}"),
        msg(3, MessageKind.TOOL_CALL, tool_call_id="b", tool_name="y", tool_arguments="{}"),
        msg(4, MessageKind.TOOL_RESULT, tool_call_id="b", tool_name="y", tool_result="{}"),
        msg(5, MessageKind.TOOL_RESULT, tool_call_id="a", tool_name="x", tool_result="{}"),
    ]
    out = to_model_messages(messages)
    assert [m.tool_call_id for m in out if m.role is Role.TOOL] == ["a", "b"]
