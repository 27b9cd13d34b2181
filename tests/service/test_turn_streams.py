"""Cancel, disconnect, reopen and delete while a turn runs, over real gRPC
(docs/spec/api-and-streams.md "A stream's lifecycle", docs/spec/turn-loop.md "Cancellation and
interruption").

The scripted model is held mid-answer with ``GatedSleep`` and tool calls are parked with
the devstack's fault delays, so every "during" is a state the test waits for, never a
race against the clock. Every test runs on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from ballet.llm.v1 import gateway_pb2
from ballet.planner.v1 import chat_pb2, resources_pb2
from ballet.planner.v1 import planner_service_pb2 as pb

from tests.pg import PgServer
from tests.service.planner_support import reason_of
from tests.service.turn_support import (
    WAIT_S,
    ChatStream,
    Rig,
    error_reason,
    event_message,
    events,
    eventually,
    kinds,
    reset,
    start_rig,
    stop_rig,
    stored_events,
)

SETTINGS = {"PLANNER__CANCEL_GRACE": "0.5"}
END = resources_pb2.TurnEndReason
TEXT = "abcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
async def sqlite_rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    started = await start_rig(tmp_path_factory.mktemp("streams"), settings=SETTINGS)
    yield started
    await stop_rig(started)


@pytest.fixture(scope="module")
async def pg_rig(
    tmp_path_factory: pytest.TempPathFactory, pg_cluster: PgServer
) -> AsyncIterator[Rig]:
    name = f"streams_{uuid.uuid4().hex[:12]}"
    pg_cluster.create_database(name)
    started = await start_rig(
        tmp_path_factory.mktemp("streams-pg"), database_url=pg_cluster.url(name), settings=SETTINGS
    )
    try:
        yield started
    finally:
        await stop_rig(started)
        pg_cluster.drop_database(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    chosen: Rig = request.getfixturevalue(f"{request.param.replace('postgresql', 'pg')}_rig")
    reset(chosen)
    yield chosen
    reset(chosen)


def deltas_text(responses: list[chat_pb2.ChatResponse]) -> str:
    """The text the client got as deltas, stitched by offset (docs/spec/api-and-streams.md)."""
    text = ""
    for response in events(responses, "text_delta"):
        delta = response.text_delta
        assert delta.offset <= len(text), "no hole between deltas"
        text = text[: delta.offset] + delta.text
    return text


async def assert_transcript_is_what_the_stream_got(
    rig: Rig, session_id: str, received: list[chat_pb2.ChatResponse]
) -> list[Any]:
    """The stored transcript equals the messages the stream's session events carried."""
    streamed = [m for m in map(event_message, stored_events(received)) if m is not None]
    transcript = await rig.transcript(session_id)
    assert transcript == streamed
    return transcript


async def nothing_left_behind(rig: Rig, tasks_before: int) -> None:
    """No asyncio task and no pooled database connection outlives the turn."""
    await eventually(
        lambda: len(asyncio.all_tasks()) <= tasks_before,
        f"the asyncio tasks to drop back to {tasks_before}",
    )
    await eventually(lambda: rig.checked_out() == 0, "every pooled connection to be returned")
    assert running_turns(rig) == 0


def running_turns(rig: Rig) -> float:
    """The planner's ``ballet_planner_running_turns`` gauge (turns this replica runs)."""
    value = rig.app.metrics.registry.get_sample_value("ballet_planner_running_turns")
    assert value is not None
    return value


def pairs_every_call_with_its_result(request: gateway_pb2.GenerateRequest) -> None:
    calls = [c.id for m in request.messages for c in m.tool_calls]
    results = [m.tool_result.tool_call_id for m in request.messages if m.role == 3]
    assert calls and sorted(calls) == sorted(results)
    for index, message in enumerate(request.messages):
        if message.tool_calls:
            following = request.messages[index + 1 : index + 1 + len(message.tool_calls)]
            assert [m.tool_result.tool_call_id for m in following] == [
                c.id for c in message.tool_calls
            ], "each answer's results follow it, in call order"


# ---------------------------------------------------------------------------------------


async def test_cancel_during_text_keeps_what_the_client_got_marked_cut(rig: Rig) -> None:
    rig.scenario(
        [
            {"match": {"last_text_regex": "^again"}, "reply": {"text": "fresh answer"}},
            {"reply": {"text": TEXT, "chunk_chars": 2, "delay_ms": 1}},
        ]
    )
    tasks_before = len(asyncio.all_tasks())
    rig.sleep.hold(3)  # three deltas, then the model stalls mid-answer
    session_id = (await rig.create_session()).session_id
    async with rig.chat() as stream:
        await stream.open(session_id)
        await stream.opened()
        await stream.send("write the alphabet", "alpha-1")
        await stream.until(lambda r: len(deltas_text(stream.received)) >= 6)
        await rig.sleep.wait_parked()
        turn_id = stream.received[-1].turn_id
        await stream.cancel(turn_id)
        await stream.turn()
        received = stream.received
    rig.sleep.release()

    (ended,) = events(received, "turn_ended")
    assert ended.turn_ended.reason == END.TURN_END_REASON_CANCELLED
    (answer,) = events(received, "assistant_message")
    message = answer.assistant_message.message
    assert message.cut and message.text == deltas_text(received) == TEXT[:6]
    transcript = await assert_transcript_is_what_the_stream_got(rig, session_id, received)
    assert [m.kind for m in transcript] == [
        resources_pb2.MESSAGE_KIND_HUMAN,
        resources_pb2.MESSAGE_KIND_ASSISTANT,
    ]

    _, later = await rig.run_turn("again", session_id=session_id)
    assert events(later, "turn_ended")[0].turn_ended.reason == END.TURN_END_REASON_COMPLETED
    seen = rig.requests()[-1]
    assert [m.text for m in seen.messages] == ["write the alphabet", TEXT[:6], "again"]
    await nothing_left_behind(rig, tasks_before)


async def test_cancel_during_parallel_tool_calls_answers_every_call(rig: Rig) -> None:
    note = {"kind": "note", "title": "Parked", "body": "a write in flight"}
    rig.scenario(
        [
            {"match": {"last_text_regex": "^again"}, "reply": {"text": "fresh answer"}},
            {"match": {"last_role": "human"}, "reply": {"text": "Looking.", "tool_calls": [
                {"name": "get_item", "arguments": {"item_id": "PAN-9"}},
                {"name": "get_item", "arguments": {"item_id": "PAN-11"}},
                {"name": "list_skills", "arguments": {}},
                {"name": "create_knowledge", "arguments": note},
            ]}},
            {"reply": {"text": "unreachable"}},
        ]
    )  # fmt: skip
    tasks_before = len(asyncio.all_tasks())
    faults = rig.stack.faults
    faults.set(method="GetItem", delay_s=math.inf)
    faults.set(method="CreateKnowledgeEntry", delay_s=math.inf)
    log = rig.stack.call_log
    session_id = (await rig.create_session()).session_id
    async with rig.chat() as stream:
        await stream.open(session_id)
        await stream.opened()
        await stream.send("look at both", "parallel-1")
        # list_skills finishes; the two reads and the write stay in flight.
        await stream.until_kind("tool_call_finished")
        await log.wait_for(
            lambda c: c.started("GetItem") == 2 and c.started("CreateKnowledgeEntry") == 1,
            WAIT_S,
        )
        started = asyncio.get_running_loop().time()
        await stream.cancel()
        await stream.turn()
        took = asyncio.get_running_loop().time() - started
        received = stream.received
    faults.clear()

    (ended,) = events(received, "turn_ended")
    assert ended.turn_ended.reason == END.TURN_END_REASON_CANCELLED
    assert took < 0.5 + 1.0, "turn_ended within cancel_grace + 1 s"
    calls = {r.tool_call_started.message.tool_call_id: r.tool_call_started.message
             for r in events(received, "tool_call_started")}  # fmt: skip
    results = {r.tool_call_finished.message.tool_call_id: r.tool_call_finished.message
               for r in events(received, "tool_call_finished")}  # fmt: skip
    assert set(calls) == set(results) and len(calls) == 4, "every call has a result"
    by_name = {calls[i].tool_name + ":" + calls[i].tool_arguments: r for i, r in results.items()}
    assert not by_name["list_skills:{}"].tool_error
    for key, result in by_name.items():
        if key.startswith("get_item"):
            assert error_reason(result.tool_result) == "CANCELLED"
            assert "outcome is unknown" not in result.tool_result
        if key.startswith("create_knowledge"):
            assert error_reason(result.tool_result) == "CANCELLED"
            assert "outcome is unknown" in result.tool_result
    await assert_transcript_is_what_the_stream_got(rig, session_id, received)

    await rig.run_turn("again", session_id=session_id)
    pairs_every_call_with_its_result(rig.requests()[-1])
    await nothing_left_behind(rig, tasks_before)


# ---------------------------------------------------------------------------------------


async def test_a_client_that_disconnects_and_reopens_misses_nothing_and_sees_nothing_twice(
    rig: Rig,
) -> None:
    rig.scenario(
        [
            {"match": {"last_role": "human"}, "reply": {
                "tool_calls": [{"name": "list_runnable", "arguments": {}}]}},
            {"reply": {"text": TEXT, "chunk_chars": 4, "delay_ms": 1}},
        ]
    )  # fmt: skip
    rig.sleep.hold(2)  # the answer after the tool round stalls after 8 characters
    session_id = (await rig.create_session()).session_id
    async with rig.chat() as first:
        await first.open(session_id)
        await first.opened()
        await first.send("what can start?", "reopen-1")
        await first.until_kind("tool_call_started")
        turn_id = first.received[-1].turn_id
    seen = [r.sequence for r in stored_events(first.received)]
    # Disconnected: the tool round finishes and the answer streams with nobody attached.
    await rig.sleep.wait_parked()

    async with rig.chat() as second:
        await second.open(session_id, after_sequence=seen[-1])
        await second.opened()
        await second.until(lambda r: r.WhichOneof("event") == "text_delta")
        # The text so far arrives as one delta right after the replay
        # (docs/spec/api-and-streams.md).
        assert deltas_text(second.received) == TEXT[:8]
        rig.sleep.release()
        await second.turn()

    replayed = [r.sequence for r in stored_events(second.received)]
    assert seen + replayed == list(range(1, seen[-1] + len(replayed) + 1))
    assert deltas_text(second.received) == TEXT
    (answer,) = events(second.received, "assistant_message")
    assert answer.assistant_message.message.text == TEXT
    turn = await rig.get_turn(session_id, turn_id)
    assert turn.end_reason == END.TURN_END_REASON_COMPLETED


async def test_a_turn_completes_and_is_stored_while_nobody_is_attached(rig: Rig) -> None:
    rig.scenario(
        [
            {"match": {"last_role": "human", "last_text_regex": "^first"}, "reply": {
                "tool_calls": [{"name": "list_items", "arguments": {"kind": "epic"}}]}},
            {"match": {"last_role": "tool"}, "reply": {"text": "four epics"}},
            {"reply": {"text": "second answer", "chunk_chars": 3}},
        ]
    )  # fmt: skip
    session_id = (await rig.create_session()).session_id
    async with rig.chat() as first:
        await first.open(session_id)
        await first.opened()
        await first.send("first question", "gone-1")
        accepted = (await first.until_kind("message_accepted"))[-1]
    turn = await rig.ended_turn(session_id, accepted.turn_id)
    assert turn.end_reason == END.TURN_END_REASON_COMPLETED and turn.rounds == 1

    seen = [r.sequence for r in stored_events(first.received)]
    async with rig.chat() as second:
        await second.open(session_id, after_sequence=seen[-1])
        await second.opened()
        replay = await second.until_kind("turn_ended")
        await second.send("second question", "gone-2")
        live = await second.turn()
    assert kinds(replay)[-4:] == [
        "tool_call_started", "tool_call_finished", "assistant_message", "turn_ended"
    ]  # fmt: skip
    assert "text_delta" not in kinds(replay), "deltas are never replayed"
    everything = seen + [r.sequence for r in stored_events(second.received)]
    assert everything == list(range(1, everything[-1] + 1)), "each event exactly once"
    assert deltas_text(live) == "second answer"
    await assert_transcript_is_what_the_stream_got(rig, session_id, first.received + replay + live)


# --------------------------------------------------------------------------- DeleteSession


async def test_deleting_a_session_cancels_its_turn_and_ends_its_streams_not_found(
    rig: Rig,
) -> None:
    rig.scenario([{"reply": {"text": TEXT, "chunk_chars": 2, "delay_ms": 1}}])
    rig.sleep.hold(1)
    session_id = (await rig.create_session()).session_id
    async with rig.chat() as stream:
        await stream.open(session_id)
        await stream.opened()
        await stream.send("write a lot", "delete-1")
        await stream.until_kind("text_delta")
        await rig.sleep.wait_parked()
        await rig.stub.DeleteSession(
            pb.DeleteSessionRequest(session_id=session_id), metadata=rig.meta()
        )
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await _read_to_the_end(stream)
    assert ended.value.code() == grpc.StatusCode.NOT_FOUND
    await eventually(lambda: running_turns(rig) == 0, "the turn to stop")
    assert len(rig.requests()) == 1, "the deleted session's turn made no further model call"
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await rig.get_session(session_id)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    assert reason_of(gone.value) == "SESSION_NOT_FOUND"


async def _read_to_the_end(stream: ChatStream) -> None:
    while True:
        try:
            await stream.next()
        except EOFError:
            return


async def test_events_committed_while_an_open_is_checked_are_replayed(tmp_path: Path) -> None:
    """``open`` reads the session, then re-checks the project with the tracker; events
    committed in between are neither in that replay nor published to the stream yet, so
    the replay must read on to the newest event (docs/spec/api-and-streams.md: after_sequence
    replays them)."""
    rig = await start_rig(tmp_path / "stack", settings={"AUTH__PROJECT_CHECK_CACHE_S": "0"})
    try:
        rig.scenario([{"reply": {"text": "late news", "delay_ms": 1}}])
        rig.sleep.hold(0)
        session_id = (await rig.create_session()).session_id
        async with rig.chat() as watcher, rig.chat() as late:
            await watcher.open(session_id)
            await watcher.opened()
            await watcher.send("anything new?", "window-1")
            await rig.sleep.wait_parked()
            started = (await rig.get_session(session_id)).last_sequence
            calls = rig.stack.call_log.started("GetProject")
            rig.stack.faults.set(method="GetProject", delay_s=math.inf)
            await late.open(session_id, after_sequence=started)
            await rig.stack.call_log.wait_for(lambda c: c.started("GetProject") > calls, WAIT_S)
            # The late stream has read the session; the turn ends before it attaches.
            rig.sleep.release()
            await watcher.turn()
            rig.stack.faults.clear()
            await late.opened()
            await late.turn()
        last = (await rig.get_session(session_id)).last_sequence
        assert [r.sequence for r in stored_events(late.received)] == list(
            range(started + 1, last + 1)
        )
    finally:
        await stop_rig(rig)
