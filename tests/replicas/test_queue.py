"""Queued messages across two planner processes on one PostgreSQL (decision 0300).

A turn runs on replica A, held by a write the devstack delays. Messages sent with
``on_busy = ENQUEUE`` to replica B (over Chat and unary) are acknowledged at once as
queued; when A's turn ends, the queued turns run one after the other, in acceptance
order, and every stream of the session sees their events in sequence order. When A is
killed (SIGKILL) mid-turn instead, B's sweeper ends A's turn once its lease expired and
starts the queued turn, on B.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from ballet.planner.v1 import resources_pb2 as res

from tests.replicas.support import END, ChatStream, Received, Rig, rig, sequences

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

LEASE_S = 2.0
SWEEP_S = 0.5

NOTE = {"kind": "note", "title": "Queue test", "body": "Written while others wait."}
SCENARIO = {
    "rules": [
        {
            "match": {"last_role": "human", "last_text_regex": "record"},
            "reply": {
                "text": "Recording a note.",
                "tool_calls": [{"name": "create_knowledge", "arguments": NOTE}],
            },
        },
        {
            "match": {"last_role": "human", "last_text_regex": "(?P<said>.+)"},
            "reply": {"text": "Answered: {{match:said}}"},
        },
        {"match": {"last_role": "tool"}, "reply": {"text": "Recorded."}},
    ]
}


def _kinds(received: list[Received], turn_id: str) -> list[str]:
    return [r.kind for r in received if r.response.turn_id == turn_id]


async def _held_turn_on_a(r: Rig, session_id: str) -> tuple[ChatStream, ChatStream, str]:
    """Streams on A and B; a turn started on A whose write the devstack holds."""
    on_a, on_b = ChatStream.open(r.a, r.alice), ChatStream.open(r.b, r.alice)
    on_a.attach(session_id)
    on_b.attach(session_id)
    await on_a.opened()
    await on_b.opened()
    r.stack.faults.set(method="CreateKnowledgeEntry", delay_s=math.inf)
    on_a.say("please record a note", "send-1")
    await r.stack.call_log.wait_for(lambda log: log.started("CreateKnowledgeEntry") == 1)
    accepted = await on_a.wait_kind("message_accepted")
    return on_a, on_b, accepted.response.turn_id


async def test_messages_queued_on_b_run_in_order_when_the_turn_on_a_ends(
    tmp_path: Path, pg_url: str
) -> None:
    async with rig(tmp_path, pg_url, SCENARIO) as r:
        session_id = await r.a.create_session(r.alice, "create-1")
        on_a, on_b, first = await _held_turn_on_a(r, session_id)

        on_b.say("second message", "send-2", res.ON_BUSY_ENQUEUE)
        queued = await on_b.wait_kind("message_queued")
        unary = await r.b.send_message(
            r.alice, session_id, "third message", "send-3", on_busy=res.ON_BUSY_ENQUEUE
        )

        second = queued.response.turn_id
        # The live echo of the request id can lose to the heal read of the same event
        # (decision 0203 echoes it once, on the copy this replica publishes): the turn
        # names its request id either way.
        assert queued.response.request_id in ("send-2", "")
        queued_turn = await r.b.get_turn(r.alice, session_id, second)
        assert queued_turn.request_id == "send-2"
        assert queued_turn.state == res.TURN_STATE_QUEUED
        assert queued_turn.queued_text == "second message"
        assert queued.response.message_queued.behind_turn_id == first
        assert unary.disposition == res.MESSAGE_DISPOSITION_QUEUED
        assert unary.turn.state == res.TURN_STATE_QUEUED
        assert unary.turn.behind_turn_id == second
        third = unary.turn.turn_id
        await on_a.wait_kind("message_queued", count=2)
        # A resend stores nothing more.
        again = await r.a.send_message(
            r.alice, session_id, "third message", "send-3", on_busy=res.ON_BUSY_ENQUEUE
        )
        assert again.turn.turn_id == third

        r.stack.faults.clear()
        for stream in (on_a, on_b):
            for turn_id in (first, second, third):
                ended = await stream.turn_ended(turn_id, timeout_s=20)
                assert ended.response.turn_ended.reason == END.TURN_END_REASON_COMPLETED
            events = stream.events()
            assert sequences(events) == list(range(1, len(events) + 1))
            order = [r.response.turn_id for r in events if r.kind == "turn_started"]
            assert order == [first, second, third]
            assert _kinds(events, third)[-4:] == [
                "message_accepted",
                "turn_started",
                "assistant_message",
                "turn_ended",
            ]
        messages = await r.b.messages(r.alice, session_id)
        humans = [m.text for m in messages if m.kind == res.MESSAGE_KIND_HUMAN]
        assert humans == ["please record a note", "second message", "third message"]
        answers = [m.text for m in messages if m.kind == res.MESSAGE_KIND_ASSISTANT]
        assert answers[-2:] == ["Answered: second message", "Answered: third message"]
        await on_a.close()
        await on_b.close()


async def test_with_a_killed_the_queued_turn_runs_on_b_after_the_sweeper(
    tmp_path: Path, pg_url: str
) -> None:
    settings = {"lease_s": LEASE_S, "sweep_interval_s": SWEEP_S}
    async with rig(tmp_path, pg_url, SCENARIO, planner=settings) as r:
        session_id = await r.a.create_session(r.alice, "create-1")
        on_a, on_b, first = await _held_turn_on_a(r, session_id)
        on_b.say("after the crash", "send-2", res.ON_BUSY_ENQUEUE)
        queued = (await on_b.wait_kind("message_queued")).response.turn_id

        r.a.kill()

        ended = await on_b.turn_ended(first, timeout_s=LEASE_S + SWEEP_S + 10)
        assert ended.response.turn_ended.reason == END.TURN_END_REASON_INTERRUPTED
        r.stack.faults.clear()
        answered = await on_b.turn_ended(queued, timeout_s=20)
        assert answered.response.turn_ended.reason == END.TURN_END_REASON_COMPLETED
        turn = await r.b.get_turn(r.alice, session_id, queued)
        assert turn.state == res.TURN_STATE_ENDED
        messages = await r.b.messages(r.alice, session_id)
        assert messages[-1].text == "Answered: after the crash"
        await on_b.close()
        await on_a.close()
