"""Split brain, the owner cut (decisions 0311, 0314 and 0315): replica A runs a turn
and is cut from the database by DROP rules while B still reaches it; both keep their
clients.

The directions of a split brain, across the suite: ``test_split_brain.py`` cuts a
replica that runs no turn (its client is let go and resumes on the other); the first
case here cuts the replica that owns the running turn (its clients and the turn move to
the other); the second cuts a replica whose client follows a turn the other runs (the
turn goes on; the client resumes on the other and misses nothing).

The owner cut: its tool round is stored and the model is streaming the answer when the
cut comes. Then:

- B's sweeper takes the turn over once A's lease has expired and closes it
  ``INTERRUPTED``; a client watching the session on B sees that end within the lease
  plus the sweep (and a few seconds of the store's units);
- A's client has its stream ended ``UNAVAILABLE``/``REPLICA_UNAVAILABLE`` within the
  lease plus 10 s, with the ``last_sequence`` it got; it reopens on B with that
  ``after_sequence`` and gets the rest (the turn's end) with no gap and nothing twice;
- A streams the answer to its end (its client sees it all), cannot store it, and retries
  its ending until the database answers: once the cut mends, the ending is refused (B
  ended the turn first, decision 0311), so the answer A streamed is not stored and the
  turn has one end, B's;
- every tool ran once; the human's messages, acknowledged, are all stored; A is SERVING
  again at once and its next turn runs.

The follower cut: B runs the turn and streams its answer through the cut; A's client
is let go within the lease plus 10 s, reopens on B after its ``last_sequence`` and gets
the rest of the turn, so that what it got on A and on B together is what B's own client
got, each event once.

Bounds are shortened by configuration (a 4 s lease, a 1 s sweep, a 3 s unit deadline,
a 2 s TCP user timeout).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
from ballet.planner.v1 import resources_pb2 as res
from grpc_health.v1 import health_pb2

from tests.faults.net import Namespace
from tests.faults.rigs import let_go, silent_rig
from tests.replicas.support import END, ChatStream, Planner, Received, Rig, sequences
from tests.replicas.test_crash_recovery import SCENARIO as CRASH_SCENARIO

pytestmark = pytest.mark.postgres

LEASE_S = 4.0
SWEEP_S = 1.0
#: What a sweep's close may take past lease + sweep on a loaded machine (its units).
SLACK_S = 4.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: The answer after the tool round: about 2.4 s of deltas, so it ends in the cut, before
#: A's lease (and hence the mend) can: A's ending is then retried through the cut.
ANSWER = "The plan, read and recorded: done."
#: The crash test's turn (a read and a write, then an answer), the answer streamed slowly.
#: An answer of about 4 s, streamed by the replica that is not cut.
SLOW = "Streamed by the other replica, piece by piece."
SCENARIO = {
    "rules": [
        {
            "match": {"last_role": "human", "last_text_regex": "slowly"},
            "reply": {"text": SLOW, "chunk_chars": 4, "delay_ms": 350},
        },
        *CRASH_SCENARIO["rules"][:2],
        {
            "match": {"last_role": "tool"},
            "reply": {"text": ANSWER, "chunk_chars": 4, "delay_ms": 270},
        },
    ]
}


def _after_tools(got: list[Received]) -> bool:
    """Whether a delta came after both tool results: the answer streams."""
    kinds = [x.kind for x in got]
    return (
        kinds.count("tool_call_finished") == 2
        and "text_delta" in kinds[len(kinds) - kinds[::-1].index("tool_call_finished") :]
    )


#: What the owner logs when its late ending is refused: at the commit of the ending it
#: retried through the cut, or, when a lease renewal found the turn taken over first,
#: at the commit of that stop.
REFUSED = ("the turn's end was refused", "turn abandoned: StoreConflict")


async def _log_line(planner: Planner, texts: tuple[str, ...], limit_s: float) -> None:
    """Poll ``planner``'s log (bounded: another process) until it has one of ``texts``."""
    started = time.monotonic()
    while not any(text in planner.log_text() for text in texts):
        if time.monotonic() - started > limit_s:
            raise AssertionError(f"{planner.name} never logged {texts}:\n{planner.log_text()}")
        await asyncio.sleep(0.1)


def _split(tmp_path: Path) -> AbstractAsyncContextManager[tuple[Rig, Namespace]]:
    """The rig, B reaching the database by the namespace's other address."""
    return silent_rig(
        tmp_path, SCENARIO, planner={"lease_s": LEASE_S, "sweep_interval_s": SWEEP_S}, split=True
    )


async def _on_both(r: Rig, request_id: str) -> tuple[str, ChatStream, ChatStream]:
    """A new session of alice's, with a stream open on A and one on B."""
    session_id = await r.a.create_session(r.alice, request_id)
    on_a, on_b = ChatStream.open(r.a, r.alice), ChatStream.open(r.b, r.alice)
    for stream in (on_a, on_b):
        stream.attach(session_id)
        await stream.opened()
    return session_id, on_a, on_b


async def _let_go_within_bound(
    stream: ChatStream, session_id: str, cut_at: float
) -> tuple[int, float]:
    """Wait (within the lease plus 10 s of the cut) for the cut replica to let ``stream``
    go; returns its ``last_sequence`` and the seconds since the cut."""
    async with asyncio.timeout(cut_at + LEASE_S + 10 - time.monotonic()):
        await stream.ended.wait()
    return let_go(stream, session_id), time.monotonic() - cut_at


async def test_the_owner_cut_from_the_database_hands_its_turn_and_clients_to_the_other(
    tmp_path: Path,
) -> None:
    async with _split(tmp_path) as (r, net):
        session_id, on_a, watcher = await _on_both(r, "create-owner-cut")
        turn_id = await on_a.accepted("please record a note", "m1")
        # The tool round is stored (B saw both results) and the answer streams on A.
        await watcher.wait_kind("tool_call_finished", count=2)
        await on_a.wait_for(_after_tools)

        net.cut(net.inner_ip)  # A's way to the database only
        cut_at = time.monotonic()

        # The healthy side: B's sweeper ends the turn after A's lease.
        ended_on_b = await watcher.turn_ended(turn_id, timeout_s=LEASE_S + SWEEP_S + SLACK_S)
        taken_over_s = ended_on_b.at - cut_at
        assert ended_on_b.response.turn_ended.reason == END.TURN_END_REASON_INTERRUPTED

        # The cut side: A lets its client go, retryable, with where to resume.
        last, let_go_s = await _let_go_within_bound(on_a, session_id, cut_at)
        assert not any(x.kind == "turn_ended" for x in on_a.events())
        # The whole answer reached A's client before it was let go.
        shown = "".join(x.response.text_delta.text for x in on_a.received if x.kind == "text_delta")
        assert shown.endswith(ANSWER), shown
        assert await r.a.health_status() == NOT_SERVING

        # The gateway's move: reopen on B after what A delivered.
        resumed = await ChatStream.opened_on(r.b, r.alice, session_id, last)
        again = await resumed.turn_ended(turn_id)
        assert again.response.turn_ended.reason == END.TURN_END_REASON_INTERRUPTED
        got = sequences(resumed.events())
        assert got == list(range(last + 1, got[-1] + 1))

        # The cut mends: A stores nothing late, its ending is refused.
        net.mend(net.inner_ip)
        mended_at = time.monotonic()
        back_s = await r.a.wait_health(SERVING, 5)
        await _log_line(r.a, REFUSED, 15)
        refused_s = time.monotonic() - mended_at

        # One end, B's; the answer A streamed in the cut is not stored; the tool
        # round before the cut is; every call answered; each tool ran once.
        turn = await r.b.get_turn(r.alice, session_id, turn_id)
        assert (turn.state, turn.end_reason) == (
            res.TURN_STATE_ENDED,
            END.TURN_END_REASON_INTERRUPTED,
        )
        messages = await r.b.messages(r.alice, session_id)
        of_turn = [m for m in messages if m.turn_id == turn_id]
        texts = [m.text for m in of_turn if m.kind == res.MESSAGE_KIND_ASSISTANT]
        assert texts == ["Reading the plan and recording a note."], texts
        calls = [m.tool_call_id for m in of_turn if m.kind == res.MESSAGE_KIND_TOOL_CALL]
        results = [m.tool_call_id for m in of_turn if m.kind == res.MESSAGE_KIND_TOOL_RESULT]
        assert len(calls) == 2 and sorted(results) == sorted(calls)
        assert len(r.stack.calls_for("CreateKnowledgeEntry")) == 1
        assert list(r.stack.writes.values()) == [1]
        assert len(r.stack.calls_for("ListItems")) == 1

        # Both streams on B go on; A serves its next turn.
        ended = await resumed.turn_ended(await resumed.accepted("and now?", "m2"))
        assert ended.response.turn_ended.reason == END.TURN_END_REASON_COMPLETED
        on_a_again = await ChatStream.opened_on(
            r.a, r.alice, session_id, sequences(resumed.events())[-1]
        )
        third = await on_a_again.accepted("and on A?", "m3")
        await on_a_again.turn_ended(third)
        await watcher.turn_ended(third)
        assert [e.kind for e in watcher.events()].count("turn_ended") == 3
        watched = sequences(watcher.events())
        assert watched == list(range(1, watched[-1] + 1))
        texts = [m.text for m in await r.b.messages(r.alice, session_id)]
        for said in ("please record a note", "and now?", "and on A?"):
            assert texts.count(said) == 1, texts
        for stream in (watcher, resumed, on_a_again):
            await stream.close()
        print(
            f"\nsplit brain, owner cut: B ended the turn {taken_over_s:.1f} s after the "
            f"cut (lease {LEASE_S:g} s, sweep {SWEEP_S:g} s); A's stream ended after "
            f"{let_go_s:.1f} s; A SERVING {back_s:.2f} s and its late ending refused "
            f"{refused_s:.1f} s after the mend"
        )


async def test_the_cut_follower_lets_its_client_go_and_the_turn_on_the_other_goes_on(
    tmp_path: Path,
) -> None:
    async with _split(tmp_path) as (r, net):
        session_id, on_a, on_b = await _on_both(r, "create-follower-cut")
        turn_id = await on_b.accepted("answer slowly", "m1")
        await on_a.wait_kind("turn_started")  # A follows the session
        await on_b.wait_kind("text_delta")

        net.cut(net.inner_ip)  # A's way to the database only
        cut_at = time.monotonic()
        last, let_go_s = await _let_go_within_bound(on_a, session_id, cut_at)
        resumed = await ChatStream.opened_on(r.b, r.alice, session_id, last)
        ended = await resumed.turn_ended(turn_id, timeout_s=15)
        assert ended.response.turn_ended.reason == END.TURN_END_REASON_COMPLETED
        await on_b.turn_ended(turn_id)
        # What the client got on A, then on B, is what B's own client got: once, in order.
        assert sequences(on_a.events()) + sequences(resumed.events()) == sequences(on_b.events())
        messages = await r.b.messages(r.alice, session_id)
        assert [m.text for m in messages] == ["answer slowly", SLOW]

        net.mend(net.inner_ip)
        back_s = await r.a.wait_health(SERVING, 5)
        for stream in (on_b, resumed):
            await stream.close()
        print(
            f"\nsplit brain, follower cut: A's stream ended {let_go_s:.1f} s after the cut "
            f"(lease {LEASE_S:g} s); the turn on B completed; A SERVING {back_s:.2f} s after "
            "the mend"
        )
