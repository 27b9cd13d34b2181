"""A client that stops reading (docs/spec/api-and-streams.md: bounded outbound
queues).

Two ``ballet-planner serve`` processes on one PostgreSQL, with small stream queues
(``limits.stream_queue_events``). A Chat stream on process A opens the session, sends a
message that starts a long turn (six rounds, each with a 64 KB answer), and never reads.
Its HTTP/2 receive window is kept small (no BDP probing, 1 KiB look-ahead), as a client
whose buffers are full: otherwise gRPC would quietly buffer megabytes for it, and the
planner's queue would never back up.

The turn and the other streams (one on A, one on B) go on at normal speed and receive
every event; the slow stream, when it finally reads, ends ``RESOURCE_EXHAUSTED`` /
``SLOW_CONSUMER`` naming the last sequence it got; reopening with that ``after_sequence``
recovers every later session event, although they are more than the queue holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from ballet.planner.v1 import chat_pb2, planner_service_pb2_grpc

from ballet_common.grpc.status import parse
from tests.replicas.support import END, SESSION_EVENTS, ChatStream, rig, sequences

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

QUEUE_EVENTS = 16
ROUNDS = 6
BIG = "plan " * 13_000  # 65 KB: a long answer each round
SCENARIO = {
    "rules": [
        {
            "match": {"last_role": "tool", "tool_results_in_turn": ROUNDS},
            "reply": {"text": "That is all."},
        },
        {
            "match": {"last_role": "tool"},
            "reply": {"text": BIG, "tool_calls": [{"name": "list_runnable", "arguments": {}}]},
        },
        {
            "match": {"last_role": "human"},
            "reply": {"text": BIG, "tool_calls": [{"name": "list_runnable", "arguments": {}}]},
        },
    ]
}
#: message_accepted, turn_started, ROUNDS x (answer, call, result), answer, turn_ended.
TURN_EVENTS = 2 + 3 * ROUNDS + 2
#: A client whose receive buffers are full: gRPC advertises only a tiny window.
STALLED_CHANNEL = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


async def timed_turn(stream: ChatStream, text: str, request_id: str, count: int) -> float:
    """Send on ``stream``; seconds from message_accepted to turn_ended (the count-th)."""
    stream.say(text, request_id)
    accepted = await stream.wait_kind("message_accepted", count=count)
    ended = await stream.turn_ended(accepted.response.turn_id, timeout_s=30)
    assert ended.response.turn_ended.reason == END.TURN_END_REASON_COMPLETED
    return ended.at - accepted.at


async def test_a_stream_that_stops_reading_ends_slow_consumer_and_slows_nothing_else(
    tmp_path: Path, pg_url: str, record_property: Callable[[str, object], None]
) -> None:
    async with rig(
        tmp_path,
        pg_url,
        SCENARIO,
        limits={"stream_queue_events": QUEUE_EVENTS},
        # Two turns of long answers would be compacted; that is another test's subject.
        planner={"compact_at_tokens": 900_000, "model_context_tokens": 1_000_000},
    ) as r:
        session_id = await r.a.create_session(r.alice, "create-1")
        other_a, other_b = ChatStream.open(r.a, r.alice), ChatStream.open(r.b, r.alice)
        for stream in (other_a, other_b):
            stream.attach(session_id)
            await stream.opened()
        # The same turn with every stream reading: the normal speed.
        baseline = await timed_turn(other_a, "go", "send-1", count=1)

        stalled = grpc.aio.insecure_channel(r.a.address, options=STALLED_CHANNEL)
        slow = planner_service_pb2_grpc.PlannerServiceStub(stalled).Chat(metadata=r.alice)
        # It has seen the first turn already (a replay would wait for it to read).
        await slow.write(
            chat_pb2.ChatRequest(
                open=chat_pb2.OpenAction(session_id=session_id, after_sequence=TURN_EVENTS)
            )
        )
        await slow.write(
            chat_pb2.ChatRequest(
                request_id="send-2", send_message=chat_pb2.SendMessageAction(text="go on")
            )
        )
        accepted = await other_a.wait_kind("message_accepted", count=2)
        turn_id = accepted.response.turn_id
        ended = await other_a.turn_ended(turn_id, timeout_s=30)
        assert ended.response.turn_ended.reason == END.TURN_END_REASON_COMPLETED
        with_slow = ended.at - accepted.at
        record_property("turn_s", round(baseline, 3))
        record_property("turn_with_slow_stream_s", round(with_slow, 3))
        assert with_slow <= 2 * baseline + 1.0, f"{with_slow:.2f} s, normally {baseline:.2f} s"
        await other_b.turn_ended(turn_id, timeout_s=5)

        # The other streams got every event of both turns, in order, promptly.
        for stream in (other_a, other_b):
            got = sequences(stream.events())
            assert got == list(range(1, 2 * TURN_EVENTS + 1)), [e.kind for e in stream.events()]
            for event in stream.events():
                message = getattr(getattr(event.response, event.kind), "message", None)
                if message is not None and message.HasField("create_time"):
                    lag = event.wall - message.create_time.ToDatetime().timestamp()
                    assert lag <= 1.0, (event.kind, lag)

        # Now the slow client reads: what was handed to it, then SLOW_CONSUMER.
        received: list[chat_pb2.ChatResponse] = []
        with pytest.raises(grpc.aio.AioRpcError) as ended_slow:
            while True:
                response = await slow.read()
                assert response is not grpc.aio.EOF, "the slow stream ended cleanly"
                received.append(response)
        await stalled.close()
        error = ended_slow.value
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        failure = parse(error)
        assert failure.reason == "SLOW_CONSUMER"
        got = [x.sequence for x in received if x.WhichOneof("event") in SESSION_EVENTS]
        last = got[-1] if got else TURN_EVENTS
        assert got == list(range(TURN_EVENTS + 1, last + 1))
        assert failure.metadata["last_sequence"] == str(last)
        assert last < 2 * TURN_EVENTS, "the slow stream got everything: it never backed up"
        record_property("slow_stream_last_sequence", last)

        # Reopening after the last event it got recovers every later one, though they
        # are more than its queue holds.
        reopened = ChatStream.open(r.a, r.alice)
        started = time.monotonic()
        reopened.attach(session_id, after_sequence=last)
        await reopened.turn_ended(turn_id, timeout_s=10)
        assert 2 * TURN_EVENTS - last > QUEUE_EVENTS
        assert sequences(reopened.events()) == list(range(last + 1, 2 * TURN_EVENTS + 1))
        mine = {e.response.sequence: e.response for e in reopened.events()}
        theirs = {e.response.sequence: e.response for e in other_a.events()}
        assert all(mine[s] == theirs[s] for s in mine)
        record_property("reopen_replay_s", round(time.monotonic() - started, 3))
        assert time.monotonic() - started < 5
        for stream in (other_a, other_b, reopened):
            await stream.close()
