"""Every limit of docs/spec/api-and-streams.md and docs/spec/limits.md, crossed, with the error it
names: human text, tool calls per answer, running turns per human and per project, open streams per
human, the gRPC receive limit, keepalive and concurrency settings, ListMessages page bytes,
``max_replay_events``, ``after_sequence`` beyond the last, the open timeout, request ids, and
``planner.max_writes_per_turn``. (The stream queue bound, SLOW_CONSUMER, is tested with the replica
tests.)

One devstack (with the scripted gateway) serves the module; each test starts its own
planner on its own SQLite database with the limits it needs. The cross-replica counts
are tested with two planners on PostgreSQL in ``test_replica_limits.py``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from ballet.planner.v1 import chat_pb2, planner_service_pb2_grpc, resources_pb2
from ballet.planner.v1 import planner_service_pb2 as pb

from service.config import load_settings
from service.server.root import server_options
from tests.hardening.support import (
    QUICK_RULES,
    Chat,
    Planner,
    Stack,
    create_session,
    error_info,
    eventually,
    failure,
    open_request,
    refused,
    retry_delay_s,
    send_request,
    start_stack,
    within,
)

KiB = 1024
MiB = 1024 * KiB

#: A model that holds every answer for a minute: turns stay running until cancelled.
HOLD_RULES: list[dict[str, Any]] = [{"reply": {"text": "slow", "delay_ms": 60_000}}]


@pytest.fixture(scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    started = await start_stack(tmp_path_factory.mktemp("limits"))
    try:
        yield started
    finally:
        await started.stop()


@pytest.fixture
async def planner_factory(stack: Stack, tmp_path: Path) -> AsyncIterator[Any]:
    """Start planners on a fresh SQLite database of this test; stopped after it."""
    started: list[Planner] = []

    async def start(rules: list[dict[str, Any]] | None = None, **settings: str) -> Planner:
        stack.provider.set_scenario({"rules": rules if rules is not None else QUICK_RULES})
        settings.setdefault("DATABASE__URL", f"sqlite+aiosqlite:///{tmp_path / 'planner.db'}")
        planner = await stack.planner(**settings)
        started.append(planner)
        return planner

    try:
        yield start
    finally:
        for planner in started:
            stack.planners.remove(planner)
            await planner.stop()
        stack.devstack.faults.clear()


def error_of(response: chat_pb2.ChatResponse) -> tuple[int, str]:
    assert response.WhichOneof("event") == "error", response
    return response.error.code, error_info(response.error).reason


async def last_sequence(planner: Planner, stack: Stack, session_id: str) -> int:
    response = await planner.stub.ListMessages(
        pb.ListMessagesRequest(session_id=session_id, page_size=1000), metadata=stack.auth()
    )
    return max((m.sequence for m in response.messages), default=0)


# --------------------------------------------------------------------------- text size


async def test_human_text_over_32_kib_is_message_too_long(
    stack: Stack, planner_factory: Any
) -> None:
    planner = await planner_factory()
    chat = Chat(planner.stub, stack.auth())
    await chat.open("open-1")
    # Exactly 32 KiB of UTF-8 is accepted.
    ended = await chat.turn("a" * (32 * KiB), "fits")
    assert ended.turn_ended.reason == resources_pb2.TURN_END_REASON_COMPLETED
    stored = await last_sequence(planner, stack, chat.session_id)
    # One byte more, in ASCII or in two-byte characters (bytes count, not characters).
    for index, text in enumerate(("a" * (32 * KiB + 1), "é" * (16 * KiB + 1))):
        await chat.send(send_request(text, f"too-long-{index}"))
        reply = await chat.until("error")
        assert error_of(reply) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], "MESSAGE_TOO_LONG")
        assert reply.request_id == f"too-long-{index}"
    # The stream stays open, nothing was stored, and the refused id may be used again.
    assert await last_sequence(planner, stack, chat.session_id) == stored
    ended = await chat.turn("short now", "too-long-0")
    assert ended.turn_ended.reason == resources_pb2.TURN_END_REASON_COMPLETED
    await chat.close()
    code, reason, _ = await refused(
        planner.stub.SendMessage(
            pb.SendMessageRequest(
                session_id=chat.session_id, text="b" * (32 * KiB + 1), request_id="unary"
            ),
            metadata=stack.auth(),
        )
    )
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "MESSAGE_TOO_LONG")


# --------------------------------------------------------------------------- tool calls


async def test_tool_calls_over_16_get_too_many_calls_and_the_turn_goes_on(
    stack: Stack, planner_factory: Any
) -> None:
    rules = [
        {
            "match": {"last_role": "human"},
            # Distinct arguments: an exact repeat within one answer runs once (decision
            # 0292), and this test is about the number of calls, not repeats.
            "reply": {
                "tool_calls": [
                    {"name": "list_items", "arguments": {"page_size": size}}
                    for size in range(1, 19)
                ]
            },
        },
        {"match": {"last_role": "tool"}, "reply": {"text": "All answered."}},
    ]
    planner = await planner_factory(rules)
    stack.gateway.reset()
    stack.devstack.call_log.clear()
    chat = Chat(planner.stub, stack.auth())
    await chat.open()
    await chat.send(send_request("list everything", "many"))
    started: list[chat_pb2.ChatResponse] = []
    finished: dict[str, resources_pb2.Message] = {}
    while True:
        response = await chat.read()
        kind = response.WhichOneof("event")
        if kind == "tool_call_started":
            started.append(response)
        elif kind == "tool_call_finished":
            message = response.tool_call_finished.message
            finished[message.tool_call_id] = message
        elif kind == "turn_ended":
            break
    assert response.turn_ended.reason == resources_pb2.TURN_END_REASON_COMPLETED
    assert response.turn_ended.rounds == 1
    call_ids = [r.tool_call_started.message.tool_call_id for r in started]
    assert len(call_ids) == 18 and set(finished) == set(call_ids)
    for call_id in call_ids[:16]:
        assert not finished[call_id].tool_error
    for call_id in call_ids[16:]:
        assert finished[call_id].tool_error
        assert json.loads(finished[call_id].tool_result)["error"]["reason"] == "TOO_MANY_CALLS"
    # Only 16 reached the backend; the model's next request pairs all 18 with results.
    assert len(stack.devstack.calls_for("ListItems")) == 16
    last = stack.gateway.requests[-1]
    assert sum(1 for m in last.messages if m.HasField("tool_result")) == 18
    await chat.close()


# --------------------------------------------------------------------------- running turns


async def start_held_turn(planner: Planner, metadata: Any, request_id: str) -> str:
    """Start a turn that the held model keeps running, then disconnect (a disconnect is
    not a cancel); returns the session id."""
    chat = Chat(planner.stub, metadata)
    await chat.open()
    await chat.send(send_request("hold on", request_id))
    await chat.until("turn_started")
    chat.cancel()
    return chat.session_id


async def test_a_fifth_running_turn_of_one_human_is_too_many_turns(
    stack: Stack, planner_factory: Any
) -> None:
    planner = await planner_factory(HOLD_RULES)
    alice = stack.auth()
    sessions = [await start_held_turn(planner, alice, f"held-{i}") for i in range(4)]
    fifth = await create_session(planner, alice, "fifth")
    chat = Chat(planner.stub, alice)
    await chat.open(session_id=fifth)
    await chat.send(send_request("one more", "m5"))
    reply = await chat.until("error")
    assert error_of(reply) == (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "TOO_MANY_TURNS")
    assert retry_delay_s(reply.error) == pytest.approx(1.0)
    # Unary SendMessage hears the same, as a status with RetryInfo.
    code, reason, status = await refused(
        planner.stub.SendMessage(
            pb.SendMessageRequest(session_id=fifth, text="again", request_id="u5"),
            metadata=alice,
        )
    )
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_TURNS")
    assert retry_delay_s(status) == pytest.approx(1.0)
    # Another human is not limited by alice's turns.
    await start_held_turn(planner, stack.auth("bob"), "bob-1")
    # Once one of alice's turns ends, the fifth starts.
    await planner.stub.CancelTurn(pb.CancelTurnRequest(session_id=sessions[0]), metadata=alice)
    await chat.send(send_request("one more", "m5"))
    await chat.until("turn_started")
    chat.cancel()


async def test_a_twenty_first_running_turn_of_one_project_is_too_many_turns(
    stack: Stack, planner_factory: Any
) -> None:
    # Per human 15 here, so that two humans reach the project's default 20 and the
    # refusal can only come from the project's count.
    planner = await planner_factory(HOLD_RULES, LIMITS__TURNS_PER_HUMAN="15")
    alice, bob = stack.auth(), stack.auth("bob")
    for index in range(15):
        await start_held_turn(planner, alice, f"a-{index}")
    for index in range(5):
        await start_held_turn(planner, bob, f"b-{index}")
    session = await create_session(planner, bob, "b-21")
    code, reason, status = await refused(
        planner.stub.SendMessage(
            pb.SendMessageRequest(session_id=session, text="one more", request_id="b-21"),
            metadata=bob,
        )
    )
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_TURNS")
    assert "project" in status.message
    assert retry_delay_s(status) == pytest.approx(1.0)


# --------------------------------------------------------------------------- streams


async def test_a_seventeenth_open_stream_of_one_human_is_too_many_streams(
    stack: Stack, planner_factory: Any
) -> None:
    planner = await planner_factory()
    alice = stack.auth()
    streams = []
    for _ in range(16):
        chat = Chat(planner.stub, alice)
        await chat.open()
        streams.append(chat)
    # The project access is checked before a slot is taken: a stream of a project the
    # human may not read is refused for that, and holds nothing.
    unreadable = Chat(planner.stub, alice)
    await unreadable.send(open_request(project_id="not-a-project"))
    reply = await unreadable.until("error")
    assert error_info(reply.error).reason == "PROJECT_NOT_FOUND"
    await unreadable.close()
    extra = Chat(planner.stub, alice)
    await extra.send(open_request(project_id="demo"))
    error = await extra.ended()
    assert error is not None
    code, reason, status = failure(error)
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_STREAMS")
    assert retry_delay_s(status) == pytest.approx(1.0)
    # Bob has his own 16.
    bob = Chat(planner.stub, stack.auth("bob"))
    await bob.open()
    await bob.close()
    # A stream that ends gives its place back (its row is deleted in the background).
    await streams.pop().close()

    async def admitted() -> bool:
        chat = Chat(planner.stub, alice)
        try:
            await chat.open()
        except grpc.aio.AioRpcError:
            return False
        streams.append(chat)
        return True

    await eventually(admitted)
    for chat in streams:
        chat.cancel()


# --------------------------------------------------------------------------- transport


async def test_a_5_mib_chat_request_gets_an_error_reply_and_the_stream_goes_on(
    stack: Stack, planner_factory: Any
) -> None:
    """Between the planner's own bounds and the transport's receive limit (16 MiB) a
    request reaches its handler: the polite error reply, not the end of the stream."""
    planner = await planner_factory()
    chat = Chat(planner.stub, stack.auth())
    await chat.open("open-big")
    await chat.send(send_request("x" * (5 * MiB), "big"))
    reply = await chat.until("error")
    assert error_of(reply) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], "MESSAGE_TOO_LONG")
    assert reply.request_id == "big"
    ended = await chat.turn("short now", "after-big")
    assert ended.turn_ended.reason == resources_pb2.TURN_END_REASON_COMPLETED
    await chat.close()
    # A unary request as large gets its handler's answer too.
    code, reason, _ = await refused(
        planner.stub.CreateSession(
            pb.CreateSessionRequest(request_id="big", project_id="demo", title="x" * (5 * MiB)),
            metadata=stack.auth(),
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and reason


async def test_a_request_over_the_receive_limit_is_resource_exhausted(
    stack: Stack, planner_factory: Any
) -> None:
    """Beyond ``server.max_receive_message_bytes`` gRPC refuses the message before any
    handler: the RPC (the whole Chat stream) ends RESOURCE_EXHAUSTED without an
    ErrorInfo, the hard limit docs/clients.md gives."""
    planner = await planner_factory(SERVER__MAX_RECEIVE_MESSAGE_BYTES=str(1 * MiB))
    big = "x" * (1 * MiB + 1)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await planner.stub.CreateSession(
            pb.CreateSessionRequest(request_id="big", project_id="demo", title=big),
            metadata=stack.auth(),
        )
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    chat = Chat(planner.stub, stack.auth())
    await chat.open()
    await chat.send(send_request(big, "big"))
    error = await chat.ended()
    assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The planner keeps serving.
    session = await create_session(planner, stack.auth(), "after-big")
    assert session


def test_server_options_set_keepalive_limits_and_concurrency_explicitly() -> None:
    settings = load_settings(None, {})
    options = dict(server_options(settings))
    assert options["grpc.max_receive_message_length"] == 16 * MiB
    assert options["grpc.keepalive_time_ms"] == 60_000
    # The ping timeout is the http2 option with this grpcio; both carry the setting.
    assert options["grpc.keepalive_timeout_ms"] == 20_000
    assert options["grpc.http2.ping_timeout_ms"] == 20_000
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 5_000
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.http2.max_ping_strikes"] == 2
    assert options["grpc.max_concurrent_streams"] == settings.server.max_concurrent_streams
    assert not any("max_connection_idle" in key for key in options)
    assert settings.server.maximum_concurrent_rpcs == 10_000
    # The gateway channel carries whole contexts: sized above the server's 16 MiB.
    assert settings.dependencies.gateway.max_message_bytes == 32 * MiB


async def test_maximum_concurrent_rpcs_refuses_the_rpc_over_it(
    stack: Stack, planner_factory: Any
) -> None:
    planner = await planner_factory(SERVER__MAXIMUM_CONCURRENT_RPCS="3")
    streams = []
    for _ in range(3):
        chat = Chat(planner.stub, stack.auth())
        await chat.open()
        streams.append(chat)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await planner.stub.GetSession(
            pb.GetSessionRequest(session_id=streams[0].session_id), metadata=stack.auth()
        )
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await streams.pop().close()

    async def served() -> bool:
        try:
            await planner.stub.GetSession(
                pb.GetSessionRequest(session_id=streams[0].session_id), metadata=stack.auth()
            )
        except grpc.aio.AioRpcError:
            return False
        return True

    await eventually(served)
    for chat in streams:
        chat.cancel()


async def test_max_concurrent_streams_queues_calls_over_it_on_one_connection(
    stack: Stack, planner_factory: Any
) -> None:
    planner = await planner_factory(SERVER__MAX_CONCURRENT_STREAMS="2")
    streams = []
    for _ in range(2):
        chat = Chat(planner.stub, stack.auth())
        await chat.open()
        streams.append(chat)
    request = pb.GetSessionRequest(session_id=streams[0].session_id)
    # A third HTTP/2 stream on the same connection waits for a free one...
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await planner.stub.GetSession(request, metadata=stack.auth(), timeout=0.5)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # ...while another connection is served, and the wait ends when a stream closes.
    # (Channels share connections unless told otherwise: a local subchannel pool.)
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(planner.app.address, options=options) as other:
        stub = planner_service_pb2_grpc.PlannerServiceStub(other)
        await within(stub.GetSession(request, metadata=stack.auth()))
    waiting = planner.stub.GetSession(request, metadata=stack.auth())
    await streams.pop().close()
    assert (await within(waiting)).session.session_id == streams[0].session_id
    for chat in streams:
        chat.cancel()


# --------------------------------------------------------------------------- reading


async def test_list_messages_pages_stay_under_1_mib_with_a_message_each(
    stack: Stack, planner_factory: Any
) -> None:
    sizes = [300_000, 450_000, 120_000, 700_000, 90_000]
    rules = [
        {"match": {"last_text_regex": f"^size {size}$"}, "reply": {"text": "z" * size}}
        for size in sizes
    ]
    # A context budget that never asks for a compaction: this test is about reading.
    planner = await planner_factory(
        rules, PLANNER__MODEL_CONTEXT_TOKENS="10000000", PLANNER__COMPACT_AT_TOKENS="5000000"
    )
    chat = Chat(planner.stub, stack.auth())
    await chat.open()
    for index, size in enumerate(sizes):
        await chat.turn(f"size {size}", f"s{index}")
    await chat.close()
    seen: list[int] = []
    token = ""
    pages = 0
    while True:
        response = await planner.stub.ListMessages(
            pb.ListMessagesRequest(session_id=chat.session_id, page_size=1000, page_token=token),
            metadata=stack.auth(),
        )
        pages += 1
        assert len(response.messages) >= 1
        assert response.ByteSize() <= MiB, response.ByteSize()
        seen.extend(m.sequence for m in response.messages)
        token = response.next_page_token
        if not token:
            break
    # 1.66 MB of messages need at least two pages.
    assert pages >= 2
    assert seen == sorted(seen) and len(seen) == 10  # 5 human + 5 assistant messages


async def test_a_replay_over_max_replay_events_is_refused(
    stack: Stack, planner_factory: Any
) -> None:
    assert load_settings(None, {}).planner.max_replay_events == 1000
    planner = await planner_factory(PLANNER__MAX_REPLAY_EVENTS="5")
    chat = Chat(planner.stub, stack.auth())
    await chat.open()
    for index in range(2):
        await chat.turn("hello", f"r{index}")
    await chat.close()
    last = await last_sequence(planner, stack, chat.session_id)
    events = last + 1  # the last message is the assistant's; turn_ended follows it
    assert events > 5
    reopened = Chat(planner.stub, stack.auth())
    await reopened.send(
        chat_pb2.ChatRequest(
            request_id="replay-all",
            open=chat_pb2.OpenAction(session_id=chat.session_id, after_sequence=0),
        )
    )
    reply = await reopened.until("error")
    assert error_of(reply) == (grpc.StatusCode.FAILED_PRECONDITION.value[0], "REPLAY_TOO_LARGE")
    assert reply.request_id == "replay-all"
    # The stream stays open; a replay of exactly the limit is allowed.
    await reopened.open(session_id=chat.session_id, after_sequence=events - 5)
    replayed = [(await reopened.read()).sequence for _ in range(5)]
    assert replayed == list(range(events - 4, events + 1))
    reopened.cancel()


async def test_after_sequence_beyond_the_last_is_out_of_range(
    stack: Stack, planner_factory: Any
) -> None:
    planner = await planner_factory()
    chat = Chat(planner.stub, stack.auth())
    await chat.open()
    ended = await chat.turn("hello", "r1")
    await chat.close()
    reopened = Chat(planner.stub, stack.auth())
    for after, expected in (
        (ended.sequence + 1, (grpc.StatusCode.OUT_OF_RANGE, "SEQUENCE_OUT_OF_RANGE")),
        (-1, (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_SEQUENCE")),
    ):
        await reopened.send(
            chat_pb2.ChatRequest(
                open=chat_pb2.OpenAction(session_id=chat.session_id, after_sequence=after)
            )
        )
        assert error_of(await reopened.until("error")) == (expected[0].value[0], expected[1])
    # The last sequence itself is fine: nothing to replay, live events from there.
    await reopened.open(session_id=chat.session_id, after_sequence=ended.sequence)
    reopened.cancel()


async def test_a_stream_without_open_in_time_is_closed(stack: Stack, planner_factory: Any) -> None:
    planner = await planner_factory(LIMITS__OPEN_TIMEOUT_S="0.3")
    silent = Chat(planner.stub, stack.auth())
    # A request that is not an open does not count; the stream stays until the timeout.
    await silent.send(send_request("hi", "early"))
    assert error_of(await silent.until("error"))[1] == "NOT_OPEN"
    error = await silent.ended()
    assert error is not None
    code, reason, _ = failure(error)
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "OPEN_TIMEOUT")
    # A stream that opened in time is not closed by it.
    opened = Chat(planner.stub, stack.auth())
    await opened.open()
    ended = await opened.turn("hello", "r1")
    assert ended.turn_ended.reason == resources_pb2.TURN_END_REASON_COMPLETED
    await opened.close()


async def test_request_ids_over_64_characters_are_refused(
    stack: Stack, planner_factory: Any
) -> None:
    planner = await planner_factory()
    alice = stack.auth()
    long_id, max_id = "r" * 65, "r" * 64
    code, reason, _ = await refused(
        planner.stub.CreateSession(
            pb.CreateSessionRequest(request_id=long_id, project_id="demo"), metadata=alice
        )
    )
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_ID_TOO_LONG")
    session = await create_session(planner, alice, max_id)
    for call in (
        planner.stub.SendMessage(
            pb.SendMessageRequest(session_id=session, text="hi", request_id=long_id),
            metadata=alice,
        ),
        planner.stub.CancelTurn(
            pb.CancelTurnRequest(session_id=session, turn_id="t", request_id=long_id),
            metadata=alice,
        ),
    ):
        code, reason, _ = await refused(call)
        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_ID_TOO_LONG")
    chat = Chat(planner.stub, alice)
    await chat.send(
        chat_pb2.ChatRequest(request_id=long_id, open=chat_pb2.OpenAction(session_id=session))
    )
    reply = await chat.until("error")
    assert error_of(reply) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], "REQUEST_ID_TOO_LONG")
    await chat.open(session_id=session)
    for request_id, expected in ((long_id, "REQUEST_ID_TOO_LONG"), ("", "REQUEST_ID_REQUIRED")):
        await chat.send(send_request("hi", request_id))
        reply = await chat.until("error")
        assert error_of(reply) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], expected)
    ended = await chat.turn("hi", max_id)
    assert ended.turn_ended.reason == resources_pb2.TURN_END_REASON_COMPLETED
    await chat.close()


# --------------------------------------------------------------------------- writes


def note(title: str) -> dict[str, Any]:
    return {"name": "create_knowledge", "arguments": {"kind": "note", "title": title, "body": "b"}}


async def test_writes_over_max_writes_per_turn_get_error_results(
    stack: Stack, planner_factory: Any
) -> None:
    assert load_settings(None, {}).planner.max_writes_per_turn == 5
    rules = [
        {
            "match": {"last_role": "human", "last_text_regex": "^write many$"},
            "reply": {"tool_calls": [note(f"first {i}") for i in range(3)]},
        },
        {
            "match": {"last_role": "tool", "tool_results_in_turn": 3},
            "reply": {"tool_calls": [note(f"second {i}") for i in range(4)]},
        },
        {
            "match": {"last_role": "human", "last_text_regex": "^write one$"},
            "reply": {"tool_calls": [note("fresh budget")]},
        },
        {"match": {"last_role": "tool"}, "reply": {"text": "Written."}},
    ]
    planner = await planner_factory(rules)
    chat = Chat(planner.stub, stack.auth())
    await chat.open()

    async def run(text: str, request_id: str) -> tuple[list[str], list[str], int]:
        await chat.send(send_request(text, request_id))
        written, refusals = [], []
        while True:
            response = await chat.read()
            kind = response.WhichOneof("event")
            if kind == "knowledge_written":
                written.append(response.knowledge_written.entry_id)
            elif kind == "tool_call_finished" and response.tool_call_finished.message.tool_error:
                result = json.loads(response.tool_call_finished.message.tool_result)
                refusals.append(result["error"]["reason"])
            elif kind == "turn_ended":
                assert response.turn_ended.reason == resources_pb2.TURN_END_REASON_COMPLETED
                return written, refusals, response.turn_ended.rounds

    written, refusals, rounds = await run("write many", "w1")
    assert (len(written), refusals, rounds) == (5, ["WRITE_LIMIT_REACHED"] * 2, 2)
    written_again, refusals, _ = await run("write one", "w2")
    assert (len(written_again), refusals) == (1, [])
    await chat.close()
    # The backend saw six writes, each with its own request id (the tool call's).
    creates = stack.devstack.calls_for("CreateKnowledgeEntry")[-6:]
    assert all(c.code == grpc.StatusCode.OK and c.request_id for c in creates)
    assert len({c.request_id for c in creates}) == 6
    assert len(set(written) | set(written_again)) == 6
