"""Large payloads never drop a stream or leave a session unusable (decisions 0220-0224),
over real gRPC on loopback with the scripted model.

- A tool call of 1.5 MiB of arguments reaches every stream that keeps up, whole: the
  stream queue counts how far a client is behind, not how large one event is.
- A stream that stops reading ends ``SLOW_CONSUMER`` alone; the other stream of the
  session and the turn go on.
- An answer with 5 MiB of arguments: the call is not run (``ARGUMENTS_TOO_LARGE``), its
  arguments are stored cut, and the session's next turn completes.
- An answer of 5 MiB of text reaches the stream truncated (marked, with its full size),
  is stored whole, and the next turn completes; a gateway that takes less than the
  planner sends names its limit, and the planner cuts the request to it.
- A call without a name (and calls with invalid JSON or a shared provider id) beside a
  valid one gets an error result; the valid one runs; the turn completes.

Every test runs on SQLite and on PostgreSQL (the hot path stores messages its own way).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from ballet.planner.v1 import planner_service_pb2 as pb
from ballet.planner.v1 import planner_service_pb2_grpc, resources_pb2

from tests.pg import PgServer
from tests.service.planner_support import reason_of
from tests.service.turn_support import (
    ChatStream,
    Rig,
    error_reason,
    events,
    reset,
    start_rig,
    stop_rig,
    tool_results,
    wait_for,
)

KiB = 1024
MiB = 1024 * KiB
END = resources_pb2.TurnEndReason
KIND = resources_pb2.MessageKind
#: A client whose receive buffers are full: gRPC advertises only a tiny window, so the
#: planner's queue backs up instead of gRPC buffering megabytes for it.
STALLED_CHANNEL = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


#: Answers here carry megabytes of arguments (about a million estimated tokens each): the
#: turn's token budget (``planner.turn_max_tokens``) is raised so that these tests reach the
#: size limits they are about, not the budget (tests/unit/test_turn_budgets.py owns that).
_SETTINGS = {"PLANNER__TURN_MAX_TOKENS": "100000000"}


@pytest.fixture(scope="module")
async def sqlite_rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    started = await start_rig(tmp_path_factory.mktemp("payloads"), settings=_SETTINGS)
    yield started
    await stop_rig(started)


@pytest.fixture(scope="module")
async def pg_rig(
    tmp_path_factory: pytest.TempPathFactory, pg_cluster: PgServer
) -> AsyncIterator[Rig]:
    name = f"payloads_{uuid.uuid4().hex[:12]}"
    pg_cluster.create_database(name)
    started = await start_rig(
        tmp_path_factory.mktemp("payloads-pg"),
        database_url=pg_cluster.url(name),
        settings=_SETTINGS,
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


def changeset_of(size: int) -> str:
    """Valid ``propose_changeset`` arguments of about ``size`` bytes: tickets with long
    descriptions (the schema allows 50 operations of 40,000 characters)."""
    per_ticket = 40_000
    count = -(-size // per_ticket)
    assert count <= 50
    operations = [
        {
            "create_item": {
                "kind": "ticket",
                "title": f"Ticket {i}",
                "description": "d" * 20_000,
                "acceptance_criteria": "a" * 19_900,
            }
        }
        for i in range(count)
    ]
    return json.dumps({"title": "A large plan", "operations": operations})


def answer_after_tool(text: str = "Done.") -> dict[str, Any]:
    return {"match": {"last_role": "tool"}, "reply": {"text": text}}


async def open_stream(stream: ChatStream, session_id: str) -> None:
    await stream.open(session_id)
    await stream.opened()


def request_id() -> str:
    return f"send-{time.monotonic_ns()}"


# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["write", "read"])
async def test_a_tool_call_of_1_5_mib_reaches_every_prompt_stream_whole(
    rig: Rig, kind: str
) -> None:
    """A write's call and its result are stored in two commits, a read's in one (decision
    0114): either way both streams get the call whole and the turn's end. The read's
    arguments are too long for its schema (an error result); the write is a real
    changeset of 1.5 MiB."""
    if kind == "write":
        name, arguments = "propose_changeset", changeset_of(3 * MiB // 2)
    else:
        name, arguments = "get_item", '{"item_id": "' + "x" * (3 * MiB // 2) + '"}'
    assert len(arguments.encode()) > 3 * MiB // 2
    rig.scenario(
        [
            {
                "match": {"last_role": "human"},
                "reply": {"tool_calls": [{"name": name, "raw_arguments": arguments}]},
            },
            answer_after_tool("Done."),
        ]
    )
    session = await rig.create_session()
    async with rig.chat() as watcher, rig.chat() as sender:
        await open_stream(watcher, session.session_id)
        await open_stream(sender, session.session_id)
        await sender.send("Go ahead", request_id())
        for stream in (sender, watcher):
            got = await stream.turn()
            assert events(got, "turn_ended")[0].turn_ended.reason == END.TURN_END_REASON_COMPLETED
            started = events(got, "tool_call_started")[0].tool_call_started.message
            assert started.tool_arguments == arguments
            assert not started.cut and not started.truncated
            finished = events(got, "tool_call_finished")[0].tool_call_finished.message
            if kind == "write":
                assert not finished.tool_error, finished.tool_result
            else:
                assert error_reason(finished.tool_result) == "INVALID_ARGUMENTS"
    if kind == "write":
        assert len(rig.stack.call_log.for_method("ProposeChangeset")) == 1
    # The transcript lists the call whole (a page of one message: it is over 1 MiB).
    transcript = await rig.transcript(session.session_id)
    call = next(m for m in transcript if m.kind == KIND.MESSAGE_KIND_TOOL_CALL)
    assert call.tool_arguments == arguments and not call.truncated


async def test_after_an_answer_with_5_mib_of_arguments_the_next_turn_completes(
    rig: Rig,
) -> None:
    arguments = '{"item_id": "' + "x" * (5 * MiB) + '"}'
    rig.scenario(
        [
            {
                "match": {"last_text_regex": "^Look it up"},
                "reply": {"tool_calls": [{"name": "get_item", "raw_arguments": arguments}]},
            },
            answer_after_tool("That call was too large."),
            {"match": {"last_role": "human"}, "reply": {"text": "Hello again."}},
        ]
    )
    session_id, got = await rig.run_turn("Look it up")
    ended = events(got, "turn_ended")[0].turn_ended
    assert ended.reason == END.TURN_END_REASON_COMPLETED, ended.error_message
    # The call was not run; its arguments are stored cut, as valid JSON, marked cut.
    assert rig.stack.call_log.for_method("GetItem") == []
    started = events(got, "tool_call_started")[0].tool_call_started.message
    finished = events(got, "tool_call_finished")[0].tool_call_finished.message
    assert started.cut and len(started.tool_arguments.encode()) <= 16 * KiB
    kept = json.loads(started.tool_arguments)
    assert kept["truncated"] and kept["original_bytes"] == len(arguments.encode())
    assert arguments.startswith(kept["content"])
    assert finished.tool_error and error_reason(finished.tool_result) == "ARGUMENTS_TOO_LARGE"
    transcript = await rig.transcript(session_id)
    stored = next(m for m in transcript if m.kind == KIND.MESSAGE_KIND_TOOL_CALL)
    assert stored.cut and stored.tool_arguments == started.tool_arguments
    # The model got the cut call and the error result, in a small request.
    follow_up = rig.requests()[-1]
    assert follow_up.ByteSize() < 256 * KiB
    assert error_reason(tool_results(follow_up)[0].content) == "ARGUMENTS_TOO_LARGE"
    sent_call = next(c for m in follow_up.messages for c in m.tool_calls)
    assert json.loads(sent_call.arguments)["truncated"] is True
    # The session is as usable as before.
    _, again = await rig.run_turn("How are you?", session_id=session_id)
    ended = events(again, "turn_ended")[0].turn_ended
    assert ended.reason == END.TURN_END_REASON_COMPLETED, ended.error_message
    assert events(again, "assistant_message")[0].assistant_message.message.text == "Hello again."


async def test_a_nameless_call_beside_a_valid_one_gets_an_error_result_and_the_turn_completes(
    rig: Rig,
) -> None:
    rig.scenario(
        [
            {
                "match": {"last_role": "human"},
                "reply": {
                    "tool_calls": [
                        {"name": "", "arguments": {"kind": "epic"}},
                        {"name": "list_items", "arguments": {"kind": "epic"}},
                    ]
                },
            },
            answer_after_tool("Here are the epics."),
        ]
    )
    _, got = await rig.run_turn("What are the open epics?")
    ended = events(got, "turn_ended")[0].turn_ended
    assert ended.reason == END.TURN_END_REASON_COMPLETED, ended.error_message
    calls = [r.tool_call_started.message for r in events(got, "tool_call_started")]
    assert [c.tool_name for c in calls] == ["", "list_items"]
    results = {
        r.tool_call_finished.message.tool_call_id: r.tool_call_finished.message
        for r in events(got, "tool_call_finished")
    }
    nameless, valid = results[calls[0].tool_call_id], results[calls[1].tool_call_id]
    assert nameless.tool_error and error_reason(nameless.tool_result) == "UNKNOWN_TOOL"
    assert "no name" in json.loads(nameless.tool_result)["error"]["message"]
    assert not valid.tool_error
    assert len(rig.stack.call_log.for_method("ListItems")) == 1
    # The model saw both calls answered, each under its own id.
    follow_up = rig.requests()[-1]
    ids = [c.id for m in follow_up.messages for c in m.tool_calls]
    assert sorted(ids) == sorted(r.tool_call_id for r in tool_results(follow_up))
    assert len(set(ids)) == 2


# --------------------------------------------------------------------------- malformed calls


async def test_malformed_calls_of_one_answer_each_get_an_error_result_and_the_valid_ones_run(
    rig: Rig,
) -> None:
    """Calls without a name, with arguments that are not JSON, and two calls sharing the
    provider's id, beside valid ones: the valid ones run, the others get error results,
    every call has the planner's own id, and the next request pairs each call with its
    result (decision 0223; 0111 for the ids)."""
    rig.scenario(
        [
            {
                "match": {"last_role": "human"},
                "reply": {
                    "tool_calls": [
                        {"name": "", "raw_arguments": "not json", "id": "call_0"},
                        {"name": "list_items", "raw_arguments": '{"kind": "epic"', "id": "call_0"},
                        {"name": "list_items", "arguments": {"kind": "epic"}, "id": "call_0"},
                        {"name": "list_runnable", "arguments": {}, "id": ""},
                    ]
                },
            },
            answer_after_tool("Done."),
        ]
    )
    _, got = await rig.run_turn("What can I work on?")
    ended = events(got, "turn_ended")[0].turn_ended
    assert ended.reason == END.TURN_END_REASON_COMPLETED, ended.error_message
    calls = [r.tool_call_started.message for r in events(got, "tool_call_started")]
    results = {
        r.tool_call_finished.message.tool_call_id: r.tool_call_finished.message
        for r in events(got, "tool_call_finished")
    }
    outcomes = [
        error_reason(results[c.tool_call_id].tool_result)
        if results[c.tool_call_id].tool_error
        else "ok"
        for c in calls
    ]
    assert outcomes == ["UNKNOWN_TOOL", "INVALID_ARGUMENTS", "ok", "ok"]
    assert len({c.tool_call_id for c in calls}) == 4
    assert all(c.tool_call_id.startswith("call_") and len(c.tool_call_id) > 30 for c in calls)
    follow_up = rig.requests()[-1]
    sent = [c.id for m in follow_up.messages for c in m.tool_calls]
    answered = [r.tool_call_id for r in tool_results(follow_up)]
    # The shared provider id is not sent back for any of the three that had it.
    assert sent == answered and len(set(sent)) == 4 and "call_0" not in sent


# --------------------------------------------------------------------------- slow streams


async def test_only_the_stream_that_stops_reading_ends_slow_consumer(rig: Rig) -> None:
    """Two streams on the session; one stops reading (its receive window stays tiny),
    while each round of the turn brings 600 KiB. The other stream gets every event and
    the turn completes; the one that stopped ends ``SLOW_CONSUMER`` and nothing else."""
    big = "plan " * (120 * KiB)  # 600 KiB a round
    rounds = 4
    rig.scenario(
        [
            {
                "match": {"last_role": "tool", "tool_results_in_turn": rounds},
                "reply": {"text": "That is all."},
            },
            {
                "match": {"last_role": "tool"},
                "reply": {"text": big, "tool_calls": [{"name": "list_runnable", "arguments": {}}]},
            },
            {
                "match": {"last_role": "human"},
                "reply": {"text": big, "tool_calls": [{"name": "list_runnable", "arguments": {}}]},
            },
        ]
    )
    session = await rig.create_session()
    stalled = grpc.aio.insecure_channel(rig.app.address, options=STALLED_CHANNEL)
    try:
        stub = planner_service_pb2_grpc.PlannerServiceStub(stalled)
        slow = ChatStream(stub.Chat(metadata=rig.meta()))
        try:
            await open_stream(slow, session.session_id)
            async with rig.chat() as prompt:
                await open_stream(prompt, session.session_id)
                await prompt.send("Plan it all", request_id())
                got = await prompt.turn()
                ended = events(got, "turn_ended")[0].turn_ended
                assert ended.reason == END.TURN_END_REASON_COMPLETED, ended.error_message
                assert len(events(got, "assistant_message")) == rounds + 1
                # Every session event, in order, without a gap.
                sequences = [r.sequence for r in got if r.sequence > 0]
                assert sequences == list(range(sequences[0], sequences[0] + len(sequences)))
            # Only now does the slow stream read: what it was given, then its end.
            with pytest.raises(grpc.aio.AioRpcError) as ended_slow:
                await wait_for(slow.until(lambda _: False))
            assert ended_slow.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert reason_of(ended_slow.value) == "SLOW_CONSUMER"
        finally:
            slow.close()
    finally:
        await stalled.close()


# --------------------------------------------------------------------------- long answers


async def test_an_answer_of_5_mib_reaches_the_stream_truncated_and_the_next_turn_completes(
    rig: Rig,
) -> None:
    long_text = "All of it. " * (5 * MiB // 11 + 1)
    rig.scenario(
        [
            {"match": {"last_text_regex": "^Tell me everything"}, "reply": {"text": long_text}},
            {"match": {"last_role": "human"}, "reply": {"text": "Short this time."}},
        ]
    )
    session_id, got = await rig.run_turn("Tell me everything")
    assert events(got, "turn_ended")[0].turn_ended.reason == END.TURN_END_REASON_COMPLETED
    sent = events(got, "assistant_message")[0].assistant_message.message
    assert sent.truncated and sent.original_bytes == len(long_text.encode())
    assert not sent.cut and long_text.startswith(sent.text) and len(sent.text) > 2 * MiB
    # ListMessages lists it truncated too: a page of one message fits a client's 4 MiB.
    listed = [m for m in await rig.transcript(session_id) if m.kind == KIND.MESSAGE_KIND_ASSISTANT]
    assert listed[0].truncated and listed[0].text == sent.text
    # The stored answer is whole: the model gets all of it back in the next request.
    _, again = await rig.run_turn("And now?", session_id=session_id)
    assert events(again, "turn_ended")[0].turn_ended.reason == END.TURN_END_REASON_COMPLETED
    assert any(m.text == long_text for m in rig.requests()[-1].messages)


async def test_send_message_returns_a_long_turn_within_what_a_client_takes(rig: Rig) -> None:
    long_text = "z" * (5 * MiB)
    rig.scenario([{"match": {"last_role": "human"}, "reply": {"text": long_text}}])
    session = await rig.create_session()
    response = await rig.stub.SendMessage(
        pb.SendMessageRequest(session_id=session.session_id, text="Go", request_id=request_id()),
        metadata=rig.meta(),
    )
    assert response.turn.end_reason == END.TURN_END_REASON_COMPLETED
    assert response.ByteSize() < 4 * MiB
    answer = response.messages[-1]
    assert answer.truncated and answer.original_bytes == 5 * MiB


@pytest.fixture(scope="module")
async def small_gateway_rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    """A gateway on its own server with gRPC's default receive limit (4 MiB), while the
    planner's gateway channel says 32 MiB (its default)."""
    started = await start_rig(
        tmp_path_factory.mktemp("small-gateway"), separate_gateway=True, settings=_SETTINGS
    )
    yield started
    await stop_rig(started)


async def test_a_gateway_that_takes_less_than_the_planner_sends_gets_requests_cut_to_fit(
    small_gateway_rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig = small_gateway_rig
    reset(rig)
    long_text = "y" * (5 * MiB)
    rig.scenario(
        [
            {"match": {"last_text_regex": "^Tell me everything"}, "reply": {"text": long_text}},
            {"match": {"last_role": "human"}, "reply": {"text": "Short this time."}},
        ]
    )
    session_id, _ = await rig.run_turn("Tell me everything")
    with caplog.at_level(logging.WARNING, logger="service.adapters.gateway"):
        _, again = await rig.run_turn("And now?", session_id=session_id)
    ended = events(again, "turn_ended")[0].turn_ended
    assert ended.reason == END.TURN_END_REASON_COMPLETED, ended.error_message
    # The gateway named its limit when it refused the first request of the turn; the
    # planner cut the request to it, said which setting to change, and remembers.
    request = rig.requests()[-1]
    assert request.ByteSize() <= 4 * MiB
    cut = next(m.text for m in request.messages if m.text.startswith("yyy"))
    assert cut.endswith(f"[cut to fit the gateway's message limit: {5 * MiB} bytes in full]")
    assert any("max_message_bytes to 4194304" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="service.adapters.gateway"):
        _, third = await rig.run_turn("Once more", session_id=session_id)
    assert events(third, "turn_ended")[0].turn_ended.reason == END.TURN_END_REASON_COMPLETED
    assert not any("refused" in r.getMessage() for r in caplog.records)
