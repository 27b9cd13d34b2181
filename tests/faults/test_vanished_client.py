"""A vanished client, for real (decision 0315; docs/spec/limits.md, The server): a Chat
client's connection goes silent (DROP rules on loopback for its connection only: no
reset, no answer, as when the client's host dies) and the planner frees its stream's
slot within the bound the docs state, by the mechanism they name.

gRPC sets a TCP user timeout of ``server.keepalive_timeout_s`` on the server's
connections (keepalive is on), so a stream with data in flight is freed that long after
the data stopped being acknowledged; an idle stream puts data in flight at its next
heartbeat (``planner.stream_heartbeat_s``). Shortened by configuration: a 2 s keepalive
timeout (20 s by default), a 3 s heartbeat (20 s). One human may hold one stream
(``limits.streams_per_human`` 1), so the slot is seen freed when another connection's
open is admitted.

- Alice vanishes mid-turn (the answer streaming): her slot is freed within the keepalive
  timeout (plus slack), the turn runs to its end and is stored ``COMPLETED``, and her
  resume from another connection (on the other replica, ``after_sequence`` = the last
  event she got) gets every event after it by sequence, the end included.
- Bob vanishes while idle: his slot is freed within the heartbeat plus the keepalive
  timeout (plus slack).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from pathlib import Path

import grpc
import pytest
from ballet.planner.v1 import planner_service_pb2_grpc
from ballet.planner.v1 import resources_pb2 as res

from ballet_common.grpc.status import parse
from tests.faults.loopback import local_ports, loopback_hole
from tests.replicas.support import END, ChatStream, Metadata, Planner, rig, sequences

pytestmark = pytest.mark.postgres

KEEPALIVE_TIMEOUT_S = 2.0
HEARTBEAT_S = 3.0
#: Past the bound: the kernel's retransmission timer, the release and the slot's delete,
#: the polling (0.2 s), on a loaded machine.
SLACK_S = 3.0
#: About 10 s of deltas: the turn outlasts the vanishing.
TEXT = "A long answer, streamed in small pieces while the client is gone. " * 2
SCENARIO = {
    "rules": [
        {
            "match": {"last_role": "human"},
            "reply": {"text": TEXT, "chunk_chars": 6, "delay_ms": 450},
        }
    ]
}


def _own_connection(planner: Planner) -> Planner:
    """``planner`` reached over a connection of its own (gRPC shares one per address and
    options in a process unless told not to), so that it can vanish alone."""
    channel = grpc.aio.insecure_channel(
        planner.address, options=[("grpc.use_local_subchannel_pool", 1)]
    )
    return dataclasses.replace(
        planner, channel=channel, stub=planner_service_pb2_grpc.PlannerServiceStub(channel)
    )


async def _admitted(
    planner: Planner, meta: Metadata, session_id: str, after_sequence: int, limit_s: float
) -> ChatStream:
    """Open a stream on ``planner`` (polling, bounded: the slot is freed in another
    process) until it is admitted rather than refused ``TOO_MANY_STREAMS``."""
    started = time.monotonic()
    while True:
        stream = ChatStream.open(planner, meta)
        stream.attach(session_id, after_sequence=after_sequence)
        # Admitted: session_opened comes first; refused: the call ends with nothing.
        with contextlib.suppress(AssertionError):
            await stream.wait_for(bool)
        if stream.received and stream.received[0].kind == "session_opened":
            return stream
        await stream.close()
        assert stream.error is not None, [r.kind for r in stream.received]
        failure = parse(stream.error)
        assert failure.reason == "TOO_MANY_STREAMS", failure
        if time.monotonic() - started > limit_s:
            raise AssertionError(f"no slot freed within {limit_s} s")
        await asyncio.sleep(0.2)


async def test_a_vanished_clients_slot_is_freed_within_its_bound_and_its_turn_is_kept(
    tmp_path: Path, pg_url: str
) -> None:
    with loopback_hole() as hole:
        async with rig(
            tmp_path,
            pg_url,
            SCENARIO,
            planner={"lease_s": 4.0, "sweep_interval_s": 1.0, "stream_heartbeat_s": HEARTBEAT_S},
            limits={"streams_per_human": 1},
            server={"keepalive_timeout_s": KEEPALIVE_TIMEOUT_S},
        ) as r:
            bob = (("authorization", f"Bearer {r.stack.token('bob')}"),)
            alice_session = await r.a.create_session(r.alice, "create-alice")
            bob_session = await r.a.create_session(bob, "create-bob")
            port = int(r.a.address.rsplit(":", 1)[1])
            vanishing: dict[str, tuple[Planner, ChatStream, int]] = {}
            for name, meta, session_id in (
                ("alice", r.alice, alice_session),
                ("bob", bob, bob_session),
            ):
                before = local_ports(port)
                own = _own_connection(r.a)
                stream = ChatStream.open(own, meta)
                stream.attach(session_id)
                await stream.opened()
                (client_port,) = local_ports(port) - before
                vanishing[name] = (own, stream, client_port)

            _, alice, _ = vanishing["alice"]
            alice.say("tell me at length", "m1")
            accepted = await alice.wait_kind("message_accepted")
            turn_id = accepted.response.turn_id
            await alice.wait_kind("text_delta")
            for _, _, client_port in vanishing.values():
                hole.drop_connection(client_port, port)
            vanished_at = time.monotonic()
            last = sequences(alice.events())[-1]

            # Alice's slot: freed by the TCP user timeout while her answer streams; she
            # resumes on the other replica from the last event she got.
            resumed = await _admitted(
                r.b, r.alice, alice_session, last, KEEPALIVE_TIMEOUT_S + SLACK_S
            )
            alice_freed_s = time.monotonic() - vanished_at
            # Bob's, idle: his next heartbeat puts data in flight.
            bob_again = await _admitted(
                r.b,
                bob,
                bob_session,
                0,
                vanished_at + HEARTBEAT_S + KEEPALIVE_TIMEOUT_S + SLACK_S - time.monotonic(),
            )
            bob_freed_s = time.monotonic() - vanished_at

            # The turn went on without its client, to its end, and is stored.
            ended = await resumed.turn_ended(turn_id, timeout_s=30)
            assert ended.response.turn_ended.reason == END.TURN_END_REASON_COMPLETED
            got = sequences(resumed.events())
            assert got == list(range(last + 1, got[-1] + 1)), got
            assert any(e.kind == "assistant_message" for e in resumed.events())
            messages = await r.b.messages(r.alice, alice_session)
            assert [m.text for m in messages] == ["tell me at length", TEXT]
            assert [m.kind for m in messages] == [
                res.MESSAGE_KIND_HUMAN,
                res.MESSAGE_KIND_ASSISTANT,
            ]
            assert len(r.gateway.requests) == 1  # the turn ran once

            hole.heal()
            for own, stream, _ in vanishing.values():
                await stream.close()
                await own.channel.close()
            for stream in (resumed, bob_again):
                await stream.close()
            print(
                f"\nvanished client: slot freed {alice_freed_s:.1f} s after the vanishing "
                f"mid-turn (keepalive timeout {KEEPALIVE_TIMEOUT_S:g} s), {bob_freed_s:.1f} s "
                f"idle (heartbeat {HEARTBEAT_S:g} s)"
            )
