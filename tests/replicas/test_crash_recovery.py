"""A replica dies while it runs a turn (docs/spec/turn-loop.md, Ownership and
recovery).

Two ``ballet-planner serve`` processes share one PostgreSQL. Process A runs a turn whose
write tool call (``create_knowledge``) the devstack holds; A is then killed with SIGKILL.
Process B's sweeper closes the turn ``INTERRUPTED`` once A's lease has expired, giving the
unanswered call "interrupted; the outcome is unknown"; the next human message, sent to B,
starts a normal turn whose model request pairs every call with a result; and no
``request_id`` is ever written twice.

To make the write really happen while its outcome stays unknown to the planner, A is
frozen (SIGSTOP) before the held write is released: the backend writes and answers, and A
is killed before it reads the answer. (Released after the kill instead, the write would
never happen: the backend's handler is cancelled when A's connection drops.)
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from ballet.planner.v1 import resources_pb2 as res
from grpc_health.v1 import health_pb2

from tests.replicas.support import END, ChatStream, Rig, rig, sequences

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

LEASE_S = 2.0
SWEEP_S = 0.5
#: Room for process scheduling on a loaded CI machine on top of lease + sweep.
SLACK_S = 1.0

NOTE = {"kind": "note", "title": "Crash test", "body": "Written while the replica died."}
SCENARIO = {
    "rules": [
        {
            "match": {"last_role": "human", "last_text_regex": "record"},
            "reply": {
                "text": "Reading the plan and recording a note.",
                "tool_calls": [
                    {"name": "list_items", "arguments": {"kind": "epic"}},
                    {"name": "create_knowledge", "arguments": NOTE},
                ],
            },
        },
        {"match": {"last_role": "human"}, "reply": {"text": "Nothing else to do."}},
        {"match": {"last_role": "tool"}, "reply": {"text": "Recorded."}},
    ]
}


def _error_message(result: str) -> str:
    message: str = json.loads(result)["error"]["message"]
    return message


async def test_sigkill_during_a_write_interrupts_the_turn_and_the_next_turn_pairs_every_call(
    tmp_path: Path, pg_url: str, record_property: Callable[[str, object], None]
) -> None:
    settings = {"lease_s": LEASE_S, "sweep_interval_s": SWEEP_S}
    async with rig(tmp_path, pg_url, SCENARIO, planner=settings) as r:
        session_id = await r.a.create_session(r.alice, "create-1")
        on_a, on_b = ChatStream.open(r.a, r.alice), ChatStream.open(r.b, r.alice)
        on_a.attach(session_id)
        on_b.attach(session_id)
        await on_a.opened()
        await on_b.opened()

        r.stack.faults.set(method="CreateKnowledgeEntry", delay_s=math.inf)
        on_a.say("please record a note", "send-1")
        await r.stack.call_log.wait_for(lambda log: log.started("CreateKnowledgeEntry") == 1)
        # The read finished and B saw its result: only the write is unanswered.
        finished = await on_b.wait_kind("tool_call_finished")
        turn_id = finished.response.turn_id
        write_call = next(
            e.response.tool_call_started.message
            for e in on_b.events()
            if e.kind == "tool_call_started"
            and e.response.tool_call_started.message.tool_name == "create_knowledge"
        )

        r.a.freeze()
        frozen_at = time.monotonic()
        r.stack.faults.clear()
        await r.stack.call_log.wait_for(
            lambda log: any(
                c.code == grpc.StatusCode.OK for c in log.for_method("CreateKnowledgeEntry")
            )
        )
        assert r.stack.writes.get(write_call.tool_call_id) == 1
        r.a.kill()

        ended = await on_b.turn_ended(turn_id, timeout_s=LEASE_S + SWEEP_S + 5)
        took = ended.at - frozen_at
        record_property("interrupted_after_stop_s", round(took, 3))
        assert took <= LEASE_S + SWEEP_S + SLACK_S, f"closed {took:.2f} s after A stopped"
        # A lease renewed at most lease/3 before A stopped still held for the rest.
        assert took >= LEASE_S * 2 / 3 - 0.2, f"closed {took:.2f} s after A stopped"
        assert ended.response.turn_ended.reason == END.TURN_END_REASON_INTERRUPTED

        turn = await r.b.get_turn(r.alice, session_id, turn_id)
        assert (turn.state, turn.end_reason) == (
            res.TURN_STATE_ENDED,
            END.TURN_END_REASON_INTERRUPTED,
        )
        assert turn.error_info.reason == "INTERRUPTED"
        assert turn.rounds == 1
        await _assert_every_call_answered(r, session_id, turn_id, write_call.tool_call_id)

        # The next message, to B, starts a normal turn; the model sees every call paired.
        on_b.say("what now?", "send-2")
        accepted = await on_b.wait_kind("message_accepted", count=2)
        second = await on_b.turn_ended(accepted.response.turn_id)
        assert second.response.turn_ended.reason == END.TURN_END_REASON_COMPLETED
        request = r.gateway.requests[-1]
        calls = [call.id for m in request.messages for call in m.tool_calls]
        results = [
            m.tool_result.tool_call_id for m in request.messages if m.tool_result.tool_call_id
        ]
        assert len(calls) == 2 and results == calls
        # The request names calls as the provider did (decision 0111), not by the ids the
        # planner stored them under.
        write_wire_id = next(
            call.id for m in request.messages for call in m.tool_calls
            if call.name == "create_knowledge"
        )  # fmt: skip
        interrupted = next(
            m.tool_result for m in request.messages if m.tool_result.tool_call_id == write_wire_id
        )
        assert interrupted.is_error
        assert "interrupted; the outcome is unknown" in interrupted.content

        # B's stream saw every event of both turns once, in order, without a gap.
        assert sequences(on_b.events()) == list(range(1, sequences(on_b.events())[-1] + 1))
        # Nothing was written twice: the held write once, nothing retried it.
        assert r.stack.writes == {write_call.tool_call_id: 1}
        assert len(r.stack.calls_for("CreateKnowledgeEntry")) == 1
        await on_a.close()
        await on_b.close()


async def _assert_every_call_answered(
    r: Rig, session_id: str, turn_id: str, write_call_id: str
) -> None:
    messages = [m for m in await r.b.messages(r.alice, session_id) if m.turn_id == turn_id]
    calls = [m for m in messages if m.kind == res.MESSAGE_KIND_TOOL_CALL]
    results = [m for m in messages if m.kind == res.MESSAGE_KIND_TOOL_RESULT]
    assert sorted(m.tool_call_id for m in results) == sorted(m.tool_call_id for m in calls)
    by_call = {m.tool_call_id: m for m in results}
    assert not by_call[calls[0].tool_call_id].tool_error  # the read A stored
    unknown = by_call[write_call_id]
    assert unknown.tool_error
    assert _error_message(unknown.tool_result) == "interrupted; the outcome is unknown"


async def test_a_restarted_replica_closes_the_turns_it_owned_at_once(
    tmp_path: Path, pg_url: str, record_property: Callable[[str, object], None]
) -> None:
    # A lease far longer than the test: only A's start-up can close the turn in time.
    settings = {"lease_s": 60.0, "sweep_interval_s": 1.0}
    async with rig(tmp_path, pg_url, SCENARIO, planner=settings) as r:
        session_id = await r.a.create_session(r.alice, "create-1")
        on_b = ChatStream.open(r.b, r.alice)
        on_b.attach(session_id)
        await on_b.opened()
        r.stack.faults.set(method="CreateKnowledgeEntry", delay_s=math.inf)
        on_a = ChatStream.open(r.a, r.alice)
        on_a.attach(session_id)
        await on_a.opened()
        on_a.say("please record a note", "send-1")
        started = await on_b.wait_kind("tool_call_started", count=2)
        await r.stack.call_log.wait_for(lambda log: log.started("CreateKnowledgeEntry") == 1)
        r.a.kill()
        await on_a.close()

        # Until its lease expires, the turn still holds the session.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await r.b.send_message(r.alice, session_id, "anything", "send-2")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        r.a.respawn()
        await r.a.wait_health(health_pb2.HealthCheckResponse.SERVING)
        serving_at = time.monotonic()
        ended = await on_b.turn_ended(started.response.turn_id, timeout_s=5)
        assert ended.response.turn_ended.reason == END.TURN_END_REASON_INTERRUPTED
        # Closed during start-up, before A reported SERVING (or a notification later).
        record_property("interrupted_after_serving_s", round(ended.at - serving_at, 3))
        assert ended.at - serving_at < 1.0
        turn = await r.a.get_turn(r.alice, session_id, started.response.turn_id)
        assert turn.end_reason == END.TURN_END_REASON_INTERRUPTED
        await on_b.close()
