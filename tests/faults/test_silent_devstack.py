"""A silent devstack, for real (decisions 0140, 0315 and 0360): the tracker or the LLM
gateway goes silent (DROP rules on loopback for its port: no reset, no answer, as a
backend behind a partition) while a turn calls it.

The gateway is served on a port of its own, so each can be silenced alone. Bounds are
shortened by configuration (a 3 s tool deadline, a 6 s first-output and a 3 s idle
deadline for the model; 15, 180 and 90 s by default):

- the tracker silent: a ``CreateSession`` whose project check is not cached fails
  ``UNAVAILABLE``/``DEPENDENCY_UNAVAILABLE`` within the project deadline (2 s; 5 s by
  default) and its retry after the heal creates the session once;
- the tracker silent during a write tool call: the call fails ``DEADLINE_EXCEEDED``
  within the tool deadline, the model gets that error result (saying the write may have
  happened: the request may still reach the tracker when the hole heals) and the turn
  goes on to ``COMPLETED``;
- the gateway silent while an answer streams: the call fails ``MODEL_TIMEOUT`` within the
  idle deadline, and the turn ends ``FAILED``/``MODEL_TIMEOUT`` (not retried: output was
  shown);
- the gateway silent before a call: it fails ``MODEL_TIMEOUT`` within the first-output
  deadline, and the turn ends ``FAILED``/``MODEL_TIMEOUT``;
- after each heal the next turn works; every human message is stored once; no model call
  or tool call was made twice by the planner.

With the default deadlines (a slow case), a gateway silent for longer than the 20 s TCP
user timeout of the planner's channels (their keepalive timeout, set by gRPC) fails the
call before the 180 s first-output deadline: the connection is aborted at 20 s, the call
is retried within ``dependencies.model_retry_window_s`` (15 s of waits) while gRPC
reconnects into the silence, and the turn ends ``FAILED``/``MODEL_UNAVAILABLE``; the
request sent into the silence never reaches the gateway (it went with its connection);
after the heal the planner reconnects within a connection attempt and the next turn
completes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from ballet.llm.v1 import gateway_pb2
from ballet.planner.v1 import planner_service_pb2
from ballet.planner.v1 import resources_pb2 as res

from ballet_common.grpc.status import RpcFailure, parse
from ballet_common.tokens import Trust, dev_secret
from devstack.gateway import GatewayServicer, ScriptedProvider, add_gateway_service
from tests.faults.loopback import LoopbackHole, local_ports, loopback_hole, unacknowledged
from tests.faults.net import require_root_network
from tests.replicas.support import END, ChatStream, Received, Rig, rig

pytestmark = pytest.mark.postgres

TOOL_CALL_S = 3.0
FIRST_DELTA_S = 6.0
IDLE_S = 3.0
PROJECT_LOOKUP_S = 2.0
#: Past a deadline: the turn's commit and the event's way to the client, loaded machine.
SLACK_S = 2.5
NOTE = {"kind": "note", "title": "Silent tracker", "body": "Written into a black hole."}
SLOW = "A slow answer, one small piece at a time, until the gateway goes silent."
SCENARIO = {
    "rules": [
        {
            "match": {"last_role": "human", "last_text_regex": "note"},
            "reply": {"tool_calls": [{"name": "create_knowledge", "arguments": NOTE}]},
        },
        {
            "match": {"last_role": "human", "last_text_regex": "slowly"},
            "reply": {"text": SLOW, "chunk_chars": 4, "delay_ms": 300},
        },
        {"match": {"last_role": "human"}, "reply": {"text": "Noted."}},
        {"match": {"last_role": "tool"}, "reply": {"text": "The tracker did not answer."}},
    ]
}


@dataclass
class Stack:
    """The rig, its gateway on a port of its own, and alice's stream on A's session,
    after one turn (every connection up)."""

    r: Rig
    gateway: GatewayServicer
    gateway_port: int
    stream: ChatStream
    session_id: str


@asynccontextmanager
async def gateway_apart(
    tmp_path: Path, pg_url: str, dependencies: Mapping[str, object]
) -> AsyncIterator[Stack]:
    """The rig, with the scripted gateway on a loopback port of its own (the devstack's
    trust: the dev secret of the rig's data directory) and ``dependencies`` as more keys
    of ``[dependencies]``."""
    require_root_network()  # before anything starts
    data_dir = tmp_path / "data"
    await asyncio.to_thread(data_dir.mkdir, parents=True, exist_ok=True)
    server = grpc.aio.server()
    gateway = add_gateway_service(
        server, ScriptedProvider(SCENARIO), trust=Trust.dev(dev_secret(data_dir))
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with rig(
            tmp_path,
            pg_url,
            {"rules": []},
            more_tables={
                "dependencies": dict(dependencies),
                "dependencies.gateway": {"address": f"127.0.0.1:{port}"},
            },
        ) as r:
            session_id = await r.a.create_session(r.alice, "create-silent")
            stream = ChatStream.open(r.a, r.alice)
            stream.attach(session_id)
            await stream.opened()
            first = await _turn(stream, "hello", "m0", 1)
            await stream.turn_ended(first)
            yield Stack(r, gateway, port, stream, session_id)
            await stream.close()
    finally:
        await server.stop(0)


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


async def _turn(stream: ChatStream, text: str, request_id: str, count: int) -> str:
    """Send ``text`` and return its turn's id (the ``count``-th acceptance here)."""
    stream.say(text, request_id)
    accepted = await stream.wait_kind("message_accepted", count=count)
    return str(accepted.response.turn_id)


async def _ended(stream: ChatStream, turn_id: str, since: float, limit_s: float) -> Received:
    ended = await stream.turn_ended(turn_id, timeout_s=limit_s + 5)
    assert ended.at - since <= limit_s, f"ended {ended.at - since:.1f} s after the hole opened"
    return ended


async def test_a_silent_tracker_or_gateway_fails_the_call_within_its_deadline(
    tmp_path: Path, pg_url: str
) -> None:
    async with gateway_apart(
        tmp_path,
        pg_url,
        {
            "tool_call_s": TOOL_CALL_S,
            "model_first_delta_s": FIRST_DELTA_S,
            "model_idle_s": IDLE_S,
            "project_lookup_s": PROJECT_LOOKUP_S,
        },
    ) as apart:
        r, gateway, gateway_port = apart.r, apart.gateway, apart.gateway_port
        stream, session_id = apart.stream, apart.session_id
        bob = (("authorization", f"Bearer {r.stack.token('bob')}"),)
        tracker_port = _port(r.stack.address)

        measured: dict[str, float] = {}
        with loopback_hole() as hole:
            # The tracker silent while the tool is called.
            hole.drop_port(tracker_port)
            opened = time.monotonic()
            turn = await _turn(stream, "write a note", "m1", 2)
            # Meanwhile an RPC that must ask the tracker (bob's project check is not
            # cached) fails within the project deadline, without a client deadline.
            measured["project"], failure = await _fails(
                r.a.stub.CreateSession(
                    planner_service_pb2.CreateSessionRequest(request_id="bob-1", project_id="demo"),
                    metadata=bob,
                )
            )
            assert (failure.code, failure.reason) == (
                grpc.StatusCode.UNAVAILABLE,
                "DEPENDENCY_UNAVAILABLE",
            ), failure
            assert measured["project"] <= PROJECT_LOOKUP_S + SLACK_S, measured
            finished = await stream.wait_kind("tool_call_finished", timeout_s=TOOL_CALL_S + 10)
            measured["tool"] = finished.at - opened
            result = finished.response.tool_call_finished.message
            assert result.tool_error
            error = json.loads(result.tool_result)["error"]
            assert error["reason"] == "DEADLINE_EXCEEDED"
            assert "may or may not have happened" in error["message"]
            write_id = result.tool_call_id
            ended = await _ended(stream, turn, opened, TOOL_CALL_S + SLACK_S)
            assert ended.response.turn_ended.reason == END.TURN_END_REASON_COMPLETED
            await _caught_up(hole, tracker_port, opened)
            # Bob's retry, the same request id, creates his session, once.
            created = await r.a.stub.CreateSession(
                planner_service_pb2.CreateSessionRequest(request_id="bob-1", project_id="demo"),
                metadata=bob,
                timeout=PROJECT_LOOKUP_S + 10,
            )
            listed = await r.a.stub.ListSessions(
                planner_service_pb2.ListSessionsRequest(project_id="demo"), metadata=bob, timeout=10
            )
            assert [x.session_id for x in listed.sessions] == [created.session.session_id]

            # The gateway silent before a call.
            hole.drop_port(gateway_port)
            opened = time.monotonic()
            turn = await _turn(stream, "are you there?", "m2", 3)
            ended = await _ended(stream, turn, opened, FIRST_DELTA_S + SLACK_S)
            measured["first"] = ended.at - opened
            _failed(ended, "MODEL_TIMEOUT")
            measured["channel"] = await _caught_up(hole, gateway_port, opened)

            # The gateway silent while an answer streams.
            turn = await _turn(stream, "answer slowly", "m3", 4)
            await stream.wait_for(
                lambda got: any(x.kind == "text_delta" and x.response.turn_id == turn for x in got)
            )
            hole.drop_port(gateway_port)
            opened = time.monotonic()
            ended = await _ended(stream, turn, opened, IDLE_S + SLACK_S)
            measured["idle"] = ended.at - opened
            _failed(ended, "MODEL_TIMEOUT")
            healed = time.monotonic()
            measured["channel_idle"] = await _caught_up(hole, gateway_port, opened)

        # After the heal a new turn works.
        turn = await _turn(stream, "and now?", "m4", 5)
        ended = await stream.turn_ended(turn, timeout_s=FIRST_DELTA_S + 10)
        assert ended.response.turn_ended.reason == END.TURN_END_REASON_COMPLETED
        measured["back"] = ended.at - healed

        # Every human message stored once; the planner made each model call and tool
        # call once (the write that timed out in the hole may land after the heal, once:
        # the model was told it may have happened).
        messages = await r.a.messages(r.alice, session_id)
        humans = [m.text for m in messages if m.kind == res.MESSAGE_KIND_HUMAN]
        assert humans == ["hello", "write a note", "are you there?", "answer slowly", "and now?"]
        asked = [_last_text(request) for request in gateway.requests]
        made = [*humans[:2], "(a tool result)", *humans[2:]]
        # The call the planner gave up on in the hole may reach the gateway after the
        # heal (its cancel right behind it), or not: never twice.
        assert asked in (made, [m for m in made if m != "are you there?"]), asked
        assert len(r.stack.calls_for("CreateKnowledgeEntry")) <= 1
        assert dict(r.stack.writes) in ({}, {write_id: 1}), dict(r.stack.writes)
        print(
            f"\nsilent devstack: a project check failed {measured['project']:.1f} s (deadline "
            f"{PROJECT_LOOKUP_S:g} s) and a write {measured['tool']:.1f} s after the hole "
            f"(deadline {TOOL_CALL_S:g} s); a call {measured['first']:.1f} s (first output "
            f"{FIRST_DELTA_S:g} s), its channel caught up {measured['channel']:.1f} s after "
            f"the heal; a streaming answer {measured['idle']:.1f} s (idle {IDLE_S:g} s), its "
            f"channel caught up {measured['channel_idle']:.1f} s and a turn completed "
            f"{measured['back']:.1f} s after the heal; the timed-out write landed after the "
            f"heal {len(r.stack.writes)} time(s); the call given up reached the gateway "
            f"{asked.count('are you there?')} time(s)"
        )


def _failed(ended: Received, reason: str) -> None:
    turn_ended = ended.response.turn_ended
    assert turn_ended.reason == END.TURN_END_REASON_FAILED, turn_ended
    assert turn_ended.error_info.reason == reason, turn_ended


def _last_text(request: gateway_pb2.GenerateRequest) -> str:
    last = request.messages[-1]
    return "(a tool result)" if last.HasField("tool_result") else str(last.text)


async def _fails(call: object) -> tuple[float, RpcFailure]:
    """How long ``call`` (an RPC without a client deadline) took to fail, and how."""
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call  # type: ignore[misc]
    return time.monotonic() - started, parse(raised.value)


async def _caught_up(hole: LoopbackHole, port: int, opened: float) -> float:
    """Heal ``hole`` and return how long the connections of ``port`` took to catch up
    (nothing unacknowledged; polled, bounded: the kernel's retransmission timer does
    it). TCP retransmits at doubling intervals, so the next try after a hole of H s
    comes at most about H s after the heal (under the 20 s TCP user timeout of the
    planner's channels, after which gRPC reconnects)."""
    hole.heal()
    healed = time.monotonic()
    limit_s = healed - opened + SLACK_S
    while unacknowledged(port):
        if time.monotonic() - healed > limit_s:
            raise AssertionError(f"port {port} not caught up {limit_s:.1f} s after the heal")
        await asyncio.sleep(0.05)
    return time.monotonic() - healed


#: The TCP user timeout of the planner's outbound channels (gRPC's, from their 20 s
#: keepalive timeout: ``ballet_common.grpc.channels``).
CHANNEL_USER_TIMEOUT_S = 20.0
#: The default first-output deadline (``dependencies.model_first_delta_s``).
DEFAULT_FIRST_DELTA_S = 180.0


@pytest.mark.slow
async def test_a_gateway_silent_past_the_channels_user_timeout_fails_unavailable(
    tmp_path: Path, pg_url: str
) -> None:
    async with gateway_apart(tmp_path, pg_url, {}) as apart:
        r, gateway, gateway_port = apart.r, apart.gateway, apart.gateway_port
        stream, session_id = apart.stream, apart.session_id

        with loopback_hole() as hole:
            hole.drop_port(gateway_port)
            opened = time.monotonic()
            turn = await _turn(stream, "are you there?", "m1", 2)
            ended = await stream.turn_ended(turn, timeout_s=DEFAULT_FIRST_DELTA_S)
            failed_s = ended.at - opened
            _failed(ended, "MODEL_UNAVAILABLE")
            assert "retry window" in ended.response.turn_ended.error_message
            # Not before the connection was aborted; well before the first-output deadline.
            assert CHANNEL_USER_TIMEOUT_S <= failed_s < DEFAULT_FIRST_DELTA_S / 2, failed_s
            hole.heal()
            healed = time.monotonic()

        # gRPC reconnects on its own: at the next SYN of the connection attempt under
        # way (its connect timeout is 20 s), or at its next attempt.
        while not local_ports(gateway_port):
            assert time.monotonic() - healed < CHANNEL_USER_TIMEOUT_S + SLACK_S, "no reconnect"
            await asyncio.sleep(0.1)
        reconnected_s = time.monotonic() - healed
        turn = await _turn(stream, "and now?", "m2", 3)
        ended = await stream.turn_ended(turn, timeout_s=30)
        assert ended.response.turn_ended.reason == END.TURN_END_REASON_COMPLETED
        back_s = ended.at - healed
        messages = await r.a.messages(r.alice, session_id)
        humans = [m.text for m in messages if m.kind == res.MESSAGE_KIND_HUMAN]
        assert humans == ["hello", "are you there?", "and now?"]
        # The request sent into the silence was dropped with its connection: it never
        # reached the gateway; each of the others once.
        asked = [_last_text(request) for request in gateway.requests]
        assert asked == ["hello", "and now?"], asked
        print(
            f"\nsilent gateway, default deadlines: the call failed MODEL_UNAVAILABLE "
            f"{failed_s:.1f} s into the silence (TCP user timeout {CHANNEL_USER_TIMEOUT_S:g} s, "
            f"retry window 15 s; first-output deadline {DEFAULT_FIRST_DELTA_S:g} s); the "
            f"planner reconnected {reconnected_s:.1f} s and a turn completed {back_s:.1f} s "
            "after the heal"
        )
