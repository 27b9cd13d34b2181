"""The turn loop over real gRPC on the devstack, driven by the scripted model.

docs/spec/turn-loop.md, docs/spec/authority.md, docs/spec/api-and-streams.md and docs/performance.md
(T1). Each test sets the scripted model's rules (devstack/gateway/scripted.py), talks to the planner
with its own gRPC client, and asserts on what the planner stored and streamed, on what the model was
sent (the gateway records every request) and on what the devstack recorded.

The module shares one rig (devstack + gateway + planner on SQLite, ``max_rounds`` 3,
``cancel_grace`` 0.5 s, ``max_replay_events`` 10); tests that need other settings, a cold
cache or PostgreSQL start their own. Streams, cancels and reconnects are in
``test_turn_streams.py``; the ``buf curl`` client in ``test_turn_buf_curl.py``.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from ballet.llm.v1 import gateway_pb2
from ballet.planner.v1 import planner_service_pb2 as pb
from ballet.planner.v1 import resources_pb2

from ballet_common.grpc.status import from_status
from devstack.demo import project as demo
from service.core import prompts
from tests.pg import PgServer
from tests.service.planner_support import reason_of
from tests.service.turn_support import (
    QUIET_UPKEEP,
    Rig,
    error_reason,
    event_message,
    events,
    kinds,
    reset,
    start_rig,
    stop_rig,
    stored_events,
    tool_results,
)

MAX_ROUNDS = 3
SHARED_SETTINGS = {
    "PLANNER__MAX_ROUNDS": str(MAX_ROUNDS),
    "PLANNER__CANCEL_GRACE": "0.5",
    "PLANNER__MAX_REPLAY_EVENTS": "10",
}
END = resources_pb2.TurnEndReason


@pytest.fixture(scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    started = await start_rig(tmp_path_factory.mktemp("turns"), settings=SHARED_SETTINGS)
    yield started
    await stop_rig(started)


@pytest.fixture(scope="module")
async def pg_rig(
    tmp_path_factory: pytest.TempPathFactory, pg_cluster: PgServer
) -> AsyncIterator[Rig]:
    """The same on PostgreSQL, with a second planner replica on the same database."""
    name = f"turns_{uuid.uuid4().hex[:12]}"
    pg_cluster.create_database(name)
    started = await start_rig(
        tmp_path_factory.mktemp("turns-pg"),
        database_url=pg_cluster.url(name),
        settings=SHARED_SETTINGS,
    )
    try:
        await started.add_replica(SHARED_SETTINGS)
        yield started
    finally:
        await stop_rig(started)
        pg_cluster.drop_database(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def any_rig(request: pytest.FixtureRequest) -> Rig:
    """The shared rig on SQLite, then on PostgreSQL (docs/spec/storage.md: both are served)."""
    chosen: Rig = request.getfixturevalue("rig" if request.param == "sqlite" else "pg_rig")
    return chosen


@pytest.fixture(autouse=True)
def fresh(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test starts with real model sleeps, no faults and empty records."""
    rigs = [request.getfixturevalue(n) for n in ("rig", "pg_rig") if n in request.fixturenames]
    for shared in rigs:
        reset(shared)
    yield
    for shared in rigs:
        reset(shared)


def call_then_answer(*calls: dict[str, Any], answer: str = "noted") -> list[dict[str, Any]]:
    """Rules: the human's message gets ``calls``; any tool result gets ``answer``."""
    return [
        {"match": {"purpose": "turn", "last_role": "human"}, "reply": {"tool_calls": list(calls)}},
        {"match": {"purpose": "turn", "last_role": "tool"}, "reply": {"text": answer}},
    ]


def reason_in(response: Any) -> str:
    """The ErrorInfo reason of an ``error`` reply."""
    info = from_status(response.error)
    assert info is not None, response
    reason: str = info.reason
    return reason


def end_reason(responses: list[Any]) -> int:
    ended = events(responses, "turn_ended")
    assert len(ended) == 1, kinds(responses)
    reason: int = ended[0].turn_ended.reason
    return reason


# ---------------------------------------------------------------------------------------

ERROR_CASES = [
    pytest.param(
        "alice", {"name": "list_items", "raw_arguments": '{"kind": '}, "INVALID_ARGUMENTS",
        id="invalid-json",
    ),
    pytest.param(
        "alice", {"name": "get_item", "arguments": {"item_id": 7}}, "INVALID_ARGUMENTS",
        id="schema-violation",
    ),
    pytest.param(
        "alice", {"name": "list_items", "arguments": {"colour": "red"}}, "INVALID_ARGUMENTS",
        id="unknown-field",
    ),
    pytest.param(
        "alice", {"name": "delete_the_project", "arguments": {}}, "UNKNOWN_TOOL",
        id="unknown-tool",
    ),
    pytest.param(
        "bob",
        {"name": "propose_changeset", "arguments": {
            "title": "Bob's plan",
            "operations": [{"create_item": {"kind": "ticket", "title": "More"}}],
        }},
        "PERMISSION_DENIED",
        id="bob-proposes",
    ),
    pytest.param(
        "alice", {"name": "get_item", "arguments": {"item_id": "PAN-999"}}, "NOT_FOUND",
        id="unknown-item",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("user", "call", "reason"), ERROR_CASES)
async def test_a_failing_tool_call_is_an_error_result_and_the_turn_completes(
    rig: Rig, user: str, call: dict[str, Any], reason: str
) -> None:
    rig.scenario(call_then_answer(call))
    session_id, received = await rig.run_turn("please look", user=user)

    assert end_reason(received) == END.TURN_END_REASON_COMPLETED
    _, second = rig.requests()
    (result,) = tool_results(second)
    assert result.is_error and error_reason(result.content) == reason, result.content
    assert result.name == call["name"]
    assert second.messages[-2].tool_calls[0].id == result.tool_call_id
    stored = [m for m in await rig.transcript(session_id, user) if m.tool_error]
    assert [error_reason(m.tool_result) for m in stored] == [reason]


async def test_a_backend_failing_unavailable_is_an_error_result(rig: Rig) -> None:
    rig.stack.faults.set(method="ListItems", error=grpc.StatusCode.UNAVAILABLE)
    rig.scenario(call_then_answer({"name": "list_items", "arguments": {}}))
    _, received = await rig.run_turn("what is open?")

    assert end_reason(received) == END.TURN_END_REASON_COMPLETED
    (result,) = tool_results(rig.requests()[1])
    assert result.is_error and error_reason(result.content) == "BACKEND_UNAVAILABLE"


async def test_a_stopped_backend_and_a_slow_one_are_error_results(tmp_path: Path) -> None:
    """A stopped backend is the devstack process gone (the gateway runs apart, so the
    model stays), after the system prompt was fetched; a slow one outlives
    ``dependencies.tool_call_s``."""
    rig = await start_rig(
        tmp_path / "stack", separate_gateway=True, settings={"DEPENDENCIES__TOOL_CALL_S": "0.3"}
    )
    try:
        rig.scenario(call_then_answer({"name": "get_item", "arguments": {"item_id": "PAN-9"}}))
        rig.stack.faults.set(method="GetItem", delay_s=math.inf)
        _, received = await rig.run_turn("tell me about PAN-9")
        assert end_reason(received) == END.TURN_END_REASON_COMPLETED
        (late,) = tool_results(rig.requests()[1])
        assert late.is_error and error_reason(late.content) == "DEADLINE_EXCEEDED"
        rig.stack.faults.clear()

        # The model is held on its first answer; meanwhile the backends stop for good.
        rig.scenario(
            [
                {"match": {"last_role": "human"}, "reply": {
                    "delay_ms": 1, "tool_calls": [{"name": "list_items", "arguments": {}}]}},
                {"match": {"last_role": "tool"}, "reply": {"text": "the tracker is down"}},
            ]
        )  # fmt: skip
        rig.sleep.hold(0)
        session_id = (await rig.create_session()).session_id
        async with rig.chat() as stream:
            await stream.open(session_id)
            await stream.opened()
            await stream.send("what is open?", "stopped-1")
            await rig.sleep.wait_parked()
            await rig.stack.stop(0)
            rig.sleep.release()
            received = await stream.turn()
        assert end_reason(received) == END.TURN_END_REASON_COMPLETED
        (down,) = tool_results(rig.requests()[1])
        assert down.is_error and error_reason(down.content) == "BACKEND_UNAVAILABLE"
        assert events(received, "assistant_message")[-1].assistant_message.message.text == (
            "the tracker is down"
        )
    finally:
        await stop_rig(rig)


# ---------------------------------------------------------------------------------------


async def test_max_rounds_ends_the_turn_and_the_next_message_continues(rig: Rig) -> None:
    rig.scenario(
        [
            {"match": {"last_role": "human", "last_text_regex": "^go on"},
             "reply": {"text": "Here is what I found."}},
            {"reply": {"text": "Looking again.",
                       "tool_calls": [{"name": "list_items", "arguments": {}}]}},
        ]
    )  # fmt: skip
    session_id, received = await rig.run_turn("find everything")

    assert end_reason(received) == END.TURN_END_REASON_MAX_ROUNDS
    assert events(received, "turn_ended")[0].turn_ended.rounds == MAX_ROUNDS
    assert len(rig.requests()) == MAX_ROUNDS, "no model call after the last round"
    assert len(events(received, "tool_call_finished")) == MAX_ROUNDS

    _, received = await rig.run_turn("go on", session_id=session_id)
    assert end_reason(received) == END.TURN_END_REASON_COMPLETED
    continued = rig.requests()[MAX_ROUNDS]
    roles = [m.role for m in continued.messages]
    U, A, T = gateway_pb2.ROLE_USER, gateway_pb2.ROLE_ASSISTANT, gateway_pb2.ROLE_TOOL
    assert roles == [U, *([A, T] * MAX_ROUNDS), U]
    assert continued.messages[0].text == "find everything"
    for answer, result in zip(continued.messages[1:-1:2], continued.messages[2:-1:2], strict=True):
        assert answer.text == "Looking again."
        assert answer.tool_calls[0].id == result.tool_result.tool_call_id
        assert not result.tool_result.is_error


# ---------------------------------------------------------------------------------------


async def test_the_live_message_accepted_echoes_the_request_id_to_its_sender_alone(
    any_rig: Rig,
) -> None:
    rig = any_rig
    rig.scenario([{"reply": {"text": "hello"}}])
    session_id = (await rig.create_session()).session_id
    async with rig.chat() as sender, rig.chat() as other:
        for stream in (sender, other):
            await stream.open(session_id)
            await stream.opened()
        await sender.send("hi", "req-1")
        (mine,) = await sender.until_kind("message_accepted")
        (theirs,) = await other.until_kind("message_accepted")
        await sender.turn()
    assert mine.request_id == "req-1"
    assert theirs.request_id == ""
    assert mine.sequence == theirs.sequence


async def test_the_same_request_id_twice_gives_one_message_and_one_turn(any_rig: Rig) -> None:
    rig = any_rig
    rig.scenario([{"reply": {"text": "hello"}}])
    session_id = (await rig.create_session()).session_id
    async with rig.chat() as stream:
        await stream.open(session_id)
        await stream.opened()
        await stream.send("hi", "same-id")
        first = (await stream.until_kind("message_accepted"))[-1]
        await stream.send("hi", "same-id")
        received = await stream.turn()
        again = [r for r in events(stream.received, "message_accepted") if r.request_id][1:]
        if not again:
            again = await stream.until_kind("message_accepted")
    # The live event echoes the request id to the stream that sent it, and so does the
    # duplicate's reply.
    assert first.request_id == "same-id"
    (duplicate,) = again
    assert duplicate.request_id == "same-id"
    assert (duplicate.sequence, duplicate.turn_id) == (first.sequence, first.turn_id)
    assert end_reason(received) == END.TURN_END_REASON_COMPLETED

    unary = await rig.stub.SendMessage(
        pb.SendMessageRequest(session_id=session_id, request_id="same-id", text="hi"),
        metadata=rig.meta(),
    )
    assert unary.turn.turn_id == first.turn_id
    transcript = await rig.transcript(session_id)
    assert [m.text for m in transcript if m.kind == resources_pb2.MESSAGE_KIND_HUMAN] == ["hi"]
    assert {m.turn_id for m in transcript} == {first.turn_id}
    assert len(rig.requests()) == 1

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await rig.stub.SendMessage(
            pb.SendMessageRequest(session_id=session_id, request_id="same-id", text="other"),
            metadata=rig.meta(),
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason_of(refused.value) == "REQUEST_ID_REUSED"


async def test_two_streams_sending_at_once_start_exactly_one_turn(any_rig: Rig) -> None:
    """On PostgreSQL the second stream is attached to the other replica."""
    rig = any_rig
    rig.scenario([{"reply": {"text": "only one of you", "delay_ms": 1}}])
    rig.sleep.hold(0)  # the winner's turn stays running until released
    session_id = (await rig.create_session()).session_id
    other = len(rig.replicas) - 1
    async with rig.chat() as a, rig.chat(replica=other) as b:
        for stream in (a, b):
            await stream.open(session_id)
            await stream.opened()
        await asyncio.gather(a.send("one", "request-a"), b.send("two", "request-b"))
        for stream in (a, b):
            await stream.until_kind("turn_started")
        await rig.sleep.wait_parked()
        transcript = await rig.transcript(session_id)
        (human,) = [m for m in transcript if m.kind == resources_pb2.MESSAGE_KIND_HUMAN]
        loser, loser_id = (b, "request-b") if human.text == "one" else (a, "request-a")
        if not events(loser.received, "error"):
            await loser.until_kind("error")
        rig.sleep.release()
        for stream in (a, b):
            await stream.turn()

    (error,) = events(a.received + b.received, "error")
    assert error.request_id == loser_id and error.sequence == 0
    assert error.error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert reason_in(error) == "TURN_IN_PROGRESS"
    last = (await rig.get_session(session_id)).last_sequence
    for stream in (a, b):
        sequences = [r.sequence for r in stored_events(stream.received)]
        assert sequences == list(range(1, last + 1)), "unique, in order, without gaps"
    turns = {m.turn_id for m in await rig.transcript(session_id)}
    assert len(turns) == 1
    assert len(rig.requests()) == 1


# ---------------------------------------------------------------------------------------


async def test_the_system_prompt_holds_instructions_project_and_the_pinned_skill(
    rig: Rig,
) -> None:
    rig.scenario([{"reply": {"text": "hello"}}])
    session_id, received = await rig.run_turn("hello")

    (request,) = rig.requests()
    # The instructions first, alone (shared by every project); the project after the
    # tools (decision 0296).
    assert request.system_prompt == prompts.instructions().strip()
    system = request.system_context
    assert "- id: demo" in system and "Pantry" in system
    assert "- id: acme" in system
    assert "# Planning the demo project (1.0.0)" in system
    assert "(1.1.0)" not in system and "Every epic aims at a milestone" not in system
    assert request.project_id == "demo" and request.credential_ref == demo.MODEL_CREDENTIAL
    turn = await rig.get_turn(session_id, received[-1].turn_id)
    assert (turn.skill_name, turn.skill_version) == (demo.PLANNER_SKILL, "1.0.0")
    assert turn.instructions_version == prompts.INSTRUCTIONS_VERSION
    # Tool output never reaches the system prompt (docs/spec/authority.md, containment).
    assert all(m.role != gateway_pb2.ROLE_TOOL for m in request.messages)


# ---------------------------------------------------------------------------------------


async def test_every_tool_call_acts_for_alice_as_the_planner_and_knowledge_is_hers(
    rig: Rig,
) -> None:
    note = {"kind": "note", "title": "Shopping habits", "body": "Lists are shared per kitchen."}
    rig.scenario(
        call_then_answer(
            {"name": "list_items", "arguments": {"kind": "epic"}},
            {"name": "get_item", "arguments": {"item_id": "PAN-4"}},
            {"name": "create_knowledge", "arguments": note},
        )
    )
    session_id = (await rig.create_session()).session_id
    rig.stack.call_log.clear()
    _, received = await rig.run_turn("note this", session_id=session_id)

    assert end_reason(received) == END.TURN_END_REASON_COMPLETED
    methods = sorted(record.method for record in rig.stack.calls)
    assert {"ListItems", "GetItem", "CreateKnowledgeEntry"} <= set(methods), methods
    for record in rig.stack.calls:
        assert (record.human, record.actor) == ("alice", f"planner:{session_id}"), record
        assert record.code == grpc.StatusCode.OK
    (written,) = events(received, "knowledge_written")
    (created,) = [
        r for r in events(received, "tool_call_finished")
        if r.tool_call_finished.message.tool_name == "create_knowledge"
    ]  # fmt: skip
    entry = json.loads(created.tool_call_finished.message.tool_result)["entry"]
    assert entry["entry_id"] == written.knowledge_written.entry_id
    assert (entry["author_id"], entry["recorded_by"]) == ("alice", f"planner:{session_id}")
    (create_record,) = rig.stack.calls_for("CreateKnowledgeEntry")
    assert create_record.request_id == created.tool_call_finished.message.tool_call_id


# --------------------------------------------------------------------------- unary RPCs


async def test_send_message_returns_the_turn_and_its_messages(rig: Rig) -> None:
    rig.scenario(call_then_answer({"name": "list_runnable", "arguments": {}}, answer="ready"))
    session_id = (await rig.create_session()).session_id
    response = await rig.stub.SendMessage(
        pb.SendMessageRequest(session_id=session_id, request_id="unary-1", text="what next?"),
        metadata=rig.meta(),
    )
    assert response.turn.end_reason == END.TURN_END_REASON_COMPLETED
    assert response.turn.rounds == 1
    assert [m.kind for m in response.messages] == [
        resources_pb2.MESSAGE_KIND_HUMAN,
        resources_pb2.MESSAGE_KIND_TOOL_CALL,
        resources_pb2.MESSAGE_KIND_TOOL_RESULT,
        resources_pb2.MESSAGE_KIND_ASSISTANT,
    ]
    assert list(response.messages) == await rig.transcript(session_id)


async def test_send_message_past_its_deadline_fails_while_the_turn_goes_on(rig: Rig) -> None:
    rig.scenario([{"reply": {"text": "worth the wait", "delay_ms": 1}}])
    rig.sleep.hold(0)
    session_id = (await rig.create_session()).session_id
    call = rig.stub.SendMessage(
        pb.SendMessageRequest(session_id=session_id, request_id="late-1", text="take time"),
        metadata=rig.meta(),
        timeout=1.0,
    )
    await rig.sleep.wait_parked()  # accepted: the turn runs and the model is held
    with pytest.raises(grpc.aio.AioRpcError) as late:
        await call
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    turn_id = (await rig.get_session(session_id)).running_turn_id
    assert turn_id, "the turn still runs"
    rig.sleep.release()
    turn = await rig.ended_turn(session_id, turn_id)
    assert turn.end_reason == END.TURN_END_REASON_COMPLETED
    (answer,) = [m for m in await rig.transcript(session_id) if m.text == "worth the wait"]
    assert not answer.cut


async def test_cancel_turn_of_an_ended_turn_changes_nothing_and_of_an_unknown_one_is_not_found(
    rig: Rig,
) -> None:
    rig.scenario([{"reply": {"text": "done"}}])
    session_id, received = await rig.run_turn("hi")
    turn_id = received[-1].turn_id
    before = await rig.get_turn(session_id, turn_id)
    last = (await rig.get_session(session_id)).last_sequence

    cancelled = await rig.stub.CancelTurn(
        pb.CancelTurnRequest(session_id=session_id, turn_id=turn_id), metadata=rig.meta()
    )
    assert cancelled.turn == before
    assert (await rig.get_session(session_id)).last_sequence == last

    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await rig.stub.CancelTurn(
            pb.CancelTurnRequest(session_id=session_id, turn_id="turn_nope"), metadata=rig.meta()
        )
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


# --------------------------------------------------------------------------- T1
# (docs/performance.md)


async def test_t1_a_one_round_turn_counted(tmp_path: Path) -> None:
    """1 Chat request, 2 turn-purpose model calls, 1 tool call, 3 commits, at most
    2 system-prompt RPCs (GetProject + ReadSkill), none on the next turn (cached).

    Commits are counted from ``send_message`` to ``turn_ended``: what the turn costs, not
    what opening the stream costs."""
    rig = await start_rig(tmp_path / "stack", settings=QUIET_UPKEEP)
    try:
        rig.scenario(call_then_answer({"name": "list_items", "arguments": {}}))
        session_id = (await rig.create_session()).session_id
        chats_before = _started(rig, "Chat")
        async with rig.chat() as stream:
            await stream.open(session_id)
            await stream.opened()
            rig.stack.call_log.clear()
            commits = rig.count_commits()
            await stream.send("what is open?", "t1-1")
            await stream.turn()
            turn_commits = commits[0]

        assert _started(rig, "Chat") - chats_before == 1
        assert len(rig.requests()) == 2
        assert len(rig.requests(gateway_pb2.PURPOSE_COMPACTION)) == 0
        assert [r.method for r in rig.stack.calls if r.method == "ListItems"] == ["ListItems"]
        assert turn_commits == 3, turn_commits
        prompt_rpcs = [r.method for r in rig.stack.calls if r.method in ("GetProject", "ReadSkill")]
        assert len(prompt_rpcs) <= 2, prompt_rpcs

        rig.stack.call_log.clear()
        rig.gateway.reset()
        await rig.run_turn("and now?", session_id=session_id)
        assert [r.method for r in rig.stack.calls] == ["ListItems"], "project and skill cached"
    finally:
        await stop_rig(rig)


@pytest.mark.postgres
async def test_t1_a_one_round_turn_on_postgresql_writes_three_times_and_notifies_nothing(
    tmp_path: Path, pg_url: str
) -> None:
    """The write-transaction budget (decision 0341): on one replica a
    one-round turn makes 3 write transactions (the message with its turn; the round; the
    ending) and sends no ``pg_notify``: no other replica follows the session (decision
    0340). Write transactions are the advance of ``pg_current_snapshot()``'s xmax (only a
    writing transaction gets an xid; reading it assigns none), counted from the send to
    ``turn_ended`` on a database of its own."""
    # Lease and stream-slot renewals are writes of their own, every lease_s / 3: a long
    # lease keeps them out of the few milliseconds counted, also on a loaded machine.
    rig = await start_rig(
        tmp_path / "stack", database_url=pg_url, settings={"PLANNER__LEASE_S": "120"}
    )
    libpq = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
    try:
        rig.scenario(call_then_answer({"name": "list_items", "arguments": {}}))
        session_id = (await rig.create_session()).session_id
        async with await psycopg.AsyncConnection.connect(libpq, autocommit=True) as conn:

            async def xmax() -> int:
                cursor = await conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())")
                row = await cursor.fetchone()
                assert row is not None
                return int(row[0])

            async def followed() -> list[str]:
                cursor = await conn.execute(
                    "SELECT replica_id FROM session_follows WHERE session_id = %s", (session_id,)
                )
                return [str(r[0]) for r in await cursor.fetchall()]

            async with rig.chat() as stream:
                await stream.open(session_id)
                await stream.opened()
                # The notifier records the follow within 0.1 s: before counting.
                for _ in range(200):
                    if await followed():
                        break
                    await asyncio.sleep(0.01)
                assert await followed() == [rig.app.settings.server.replica_id]
                sent_before = _signals(rig, "sent")
                before = await xmax()
                await stream.send("what is open?", "t1-pg")
                await stream.turn()
                writes = await xmax() - before
            await rig.app.store.signals.flush(5.0)  # type: ignore[attr-defined]
        assert writes == 3, writes
        assert _signals(rig, "sent") == sent_before
        assert rig.app.store.signals.pending == 0  # type: ignore[attr-defined]
    finally:
        await stop_rig(rig)


def _signals(rig: Rig, outcome: str) -> float:
    value = rig.app.metrics.registry.get_sample_value(
        "ballet_planner_signals_total", {"outcome": outcome}
    )
    return value or 0.0


def _started(rig: Rig, method: str) -> float:
    for metric in rig.app.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "ballet_planner_grpc_server_started_total" and sample.labels.get(
                "grpc_method", ""
            ).endswith(f"/{method}"):
                return float(sample.value)
    return 0.0


# --------------------------------------------------------------------------- protocol rules


async def test_stream_protocol_errors_are_replies_and_the_stream_stays_open(rig: Rig) -> None:
    rig.scenario([{"reply": {"text": "fine"}}])
    session_id, _ = await rig.run_turn("hi")
    last = (await rig.get_session(session_id)).last_sequence
    async with rig.chat() as stream:
        await stream.send("too early", "early-1")
        early = (await stream.until_kind("error"))[-1]
        assert early.request_id == "early-1" and early.sequence == 0
        assert early.error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]

        await stream.open(session_id, after_sequence=last + 1, request_id="far-1")
        far = (await stream.until_kind("error"))[-1]
        assert far.request_id == "far-1"
        assert far.error.code == grpc.StatusCode.OUT_OF_RANGE.value[0]

        await stream.open(session_id, after_sequence=last, request_id="other", project_id="x")
        mismatch = (await stream.until_kind("error"))[-1]
        assert mismatch.request_id == "other" and reason_in(mismatch) == "PROJECT_MISMATCH"

        await stream.open(session_id, after_sequence=last, request_id="open-1")
        opened = await stream.opened()
        assert opened.last_sequence == last
        await stream.open(session_id, request_id="again-1")
        again = (await stream.until_kind("error"))[-1]
        assert again.request_id == "again-1"
        assert again.error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]

        await stream.send("still here?", "later-1")
        received = await stream.turn()
        assert end_reason(received) == END.TURN_END_REASON_COMPLETED
    assert [r.sequence for r in stored_events(stream.received)] == list(
        range(last + 1, last + 5)
    ), "after the replies, only the live turn: nothing replayed twice"


async def test_a_replay_larger_than_max_replay_events_is_refused(rig: Rig) -> None:
    rig.scenario(call_then_answer({"name": "list_items", "arguments": {}}))
    session_id, _ = await rig.run_turn("one")
    await rig.run_turn("two", session_id=session_id)
    last = (await rig.get_session(session_id)).last_sequence
    assert last > 10
    async with rig.chat() as stream:
        await stream.open(session_id, after_sequence=0, request_id="all")
        refused = (await stream.until_kind("error"))[-1]
        assert reason_in(refused) == "REPLAY_TOO_LARGE"
        await stream.open(session_id, after_sequence=last - 10, request_id="some")
        await stream.opened()
        replayed = [await stream.next() for _ in range(10)]
    assert [r.sequence for r in replayed] == list(range(last - 9, last + 1))
    messages = {m.sequence: m for m in await rig.transcript(session_id)}
    for response in replayed:
        message = event_message(response)
        if message is not None:
            assert messages[response.sequence] == message
