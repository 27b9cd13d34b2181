"""PostgreSQL stops for 10 s in the middle of a turn (docs/spec/turn-loop.md and
docs/spec/storage.md; decisions 0006 and 0070).

Two ``ballet-planner serve`` processes on a private PostgreSQL the test stops and starts.
Process A runs a turn whose read tool call (``get_item``) the devstack holds. PostgreSQL
stops; both processes report NOT_SERVING and refuse a new message with
``UNAVAILABLE``/``DATABASE_UNAVAILABLE``; the held call is released, so A's commit of its
result fails. Once PostgreSQL is back, A closes its turn ``FAILED``/``DATABASE_UNAVAILABLE``
at once (not after its lease expires), with a result for every call; both processes report
SERVING again and run new turns. An idle Chat stream stays open through the outage; the
sender's stream, half-closed during it, ends ``UNAVAILABLE`` (whether its turn ended cannot
be read) and reopens with ``after_sequence``. Every session event a client received is in
the transcript and the replay.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from ballet.planner.v1 import resources_pb2 as res
from grpc_health.v1 import health_pb2

from ballet_common.grpc.status import from_status
from tests.pg import PgCluster
from tests.replicas.support import END, ChatStream, Received, rig, sequences

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

OUTAGE_S = 10.0
#: Renewed every lease/3 = 10 s, the lease outlasts the outage by at least 10 s: only the
#: run itself can end the turn right after it (a sweeper waits for the lease to expire).
LEASE_S = 30.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

SCENARIO = {
    "rules": [
        {
            "match": {"last_role": "human", "last_text_regex": "^look"},
            "reply": {
                "text": "Looking it up.",
                "tool_calls": [{"name": "get_item", "arguments": {"item_id": "PAN-8"}}],
            },
        },
        {"match": {"last_role": "tool"}, "reply": {"text": "Found it."}},
        {"match": {"last_role": "human"}, "reply": {"text": "Back to normal.", "chunk_chars": 4}},
    ]
}


def identity(event: Received) -> tuple[int, str, str, str]:
    response = event.response
    kind = event.kind
    message = getattr(getattr(response, kind), "message", None)
    return response.sequence, kind, response.turn_id, message.message_id if message else ""


async def test_a_database_outage_mid_turn_fails_the_turn_and_the_replicas_recover(
    tmp_path: Path, own_pg_cluster: PgCluster, record_property: Callable[[str, object], None]
) -> None:
    own_pg_cluster.create_database("planner")
    url = own_pg_cluster.url("planner")
    settings = {"lease_s": LEASE_S, "sweep_interval_s": 1.0}
    async with rig(tmp_path, url, SCENARIO, planner=settings) as r:
        session_id = await r.a.create_session(r.alice, "create-1")
        on_a, on_b = ChatStream.open(r.a, r.alice), ChatStream.open(r.b, r.alice)
        for stream in (on_a, on_b):
            stream.attach(session_id)
            await stream.opened()
        r.stack.faults.set(method="GetItem", delay_s=math.inf)
        on_a.say("look up PAN-8", "send-1")
        # A round of reads is stored with its first result (decision 0114): the call is
        # known to be running by the tracker's call record, not by a stored event.
        accepted = await on_b.wait_kind("message_accepted")
        turn_id = accepted.response.turn_id
        await r.stack.call_log.wait_for(lambda log: log.started("GetItem") == 1)

        stopped_at = time.monotonic()
        await asyncio.to_thread(own_pg_cluster.stop, "fast")
        await asyncio.gather(r.a.wait_health(NOT_SERVING, 10), r.b.wait_health(NOT_SERVING, 10))
        record_property("not_serving_after_stop_s", round(time.monotonic() - stopped_at, 3))
        # A message now is refused, and nothing of it is stored (checked below).
        on_b.say("anyone there?", "send-down")
        refused = await on_b.wait_kind("error")
        assert refused.response.request_id == "send-down"
        assert refused.response.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        info = from_status(refused.response.error)
        assert info is not None and info.reason == "DATABASE_UNAVAILABLE"
        # The sender is done sending and half-closes: whether its turn ended cannot be
        # read now, so its stream ends UNAVAILABLE and it reopens later.
        on_a.half_close()
        await asyncio.wait_for(on_a.ended.wait(), 5)
        assert on_a.error is not None and on_a.error.code() == grpc.StatusCode.UNAVAILABLE
        # The held call answers; A cannot store its result.
        r.stack.faults.clear()
        await r.stack.call_log.wait_for(lambda log: len(log.for_method("GetItem")) == 1)

        # The outage itself is the scenario: keep PostgreSQL down for OUTAGE_S.
        await asyncio.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped_at)))
        await asyncio.to_thread(own_pg_cluster.start)
        back_at = time.monotonic()

        ended = await on_b.turn_ended(turn_id, timeout_s=10)
        record_property("failed_after_restart_s", round(ended.at - back_at, 3))
        assert ended.at - back_at < 5.0, f"ended {ended.at - back_at:.2f} s after the restart"
        end = ended.response.turn_ended
        assert end.reason == END.TURN_END_REASON_FAILED
        assert end.error_info.reason == "DATABASE_UNAVAILABLE"
        await asyncio.gather(r.a.wait_health(SERVING, 15), r.b.wait_health(SERVING, 15))
        record_property("serving_after_restart_s", round(time.monotonic() - back_at, 3))

        turn = await r.b.get_turn(r.alice, session_id, turn_id)
        assert (turn.state, turn.end_reason) == (res.TURN_STATE_ENDED, END.TURN_END_REASON_FAILED)
        assert turn.rounds == 1
        messages = await r.b.messages(r.alice, session_id)
        assert "anyone there?" not in [m.text for m in messages]
        calls = [m for m in messages if m.kind == res.MESSAGE_KIND_TOOL_CALL]
        results = [m for m in messages if m.kind == res.MESSAGE_KIND_TOOL_RESULT]
        assert [m.tool_call_id for m in results] == [m.tool_call_id for m in calls]
        assert results[0].tool_error

        # A's client reopens after the last event it got, and gets the rest of its turn.
        again_a = ChatStream.open(r.a, r.alice)
        again_a.attach(session_id, after_sequence=sequences(on_a.events())[-1])
        await again_a.turn_ended(turn_id, timeout_s=5)
        # The same processes serve new turns: one on A, one on B.
        for stream, request_id, count in ((again_a, "send-2", 1), (on_b, "send-3", 3)):
            stream.say("again", request_id)
            accepted = await stream.wait_kind("message_accepted", count=count)
            done = await stream.turn_ended(accepted.response.turn_id, timeout_s=10)
            assert done.response.turn_ended.reason == END.TURN_END_REASON_COMPLETED

        # Nothing a client was sent is lost: the streams saw every event once in order
        # (on B, open throughout), and the replay from the start holds each of them.
        last = sequences(on_b.events())[-1]
        await again_a.turn_ended(accepted.response.turn_id, timeout_s=5)
        assert sequences(on_b.events()) == list(range(1, last + 1))
        assert sequences(on_a.events() + again_a.events()) == list(range(1, last + 1))
        replay = ChatStream.open(r.a, r.alice)
        replay.attach(session_id, after_sequence=0)
        await replay.turn_ended(accepted.response.turn_id)
        replayed = [identity(e) for e in replay.events()]
        assert [identity(e) for e in on_a.events() + again_a.events()] == replayed
        assert [identity(e) for e in on_b.events()] == replayed
        stored = [(m.sequence, m.message_id) for m in await r.a.messages(r.alice, session_id)]
        assert stored == [(s, m) for s, _, _, m in replayed if m]
        for stream in (on_a, again_a, on_b, replay):
            await stream.close()
