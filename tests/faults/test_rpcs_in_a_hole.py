"""RPCs without a client deadline in a database black hole (decisions 0310, 0312 and
0315): each ends within the unit deadline with ``UNAVAILABLE``/``DATABASE_UNAVAILABLE``
(bounds shortened by configuration: 3 s); the replicas go NOT_SERVING; a
``SendMessage`` that failed in the hole is not executed after the heal, and its resend
with the same ``request_id`` is acknowledged right after it; nothing acknowledged before
the hole is lost.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from ballet.planner.v1 import planner_service_pb2
from grpc_health.v1 import health_pb2

from ballet_common.grpc.status import parse
from tests.faults.rigs import DATABASE, silent_rig
from tests.faults.test_split_brain import SCENARIO

pytestmark = pytest.mark.postgres

UNIT_TIMEOUT_S = float(DATABASE["unit_timeout_s"])  # type: ignore[arg-type]
SLACK_S = 1.5
HOLE_S = 15.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_rpcs_end_within_their_bound_and_a_failed_send_is_not_run_later(
    tmp_path: Path,
) -> None:
    async with silent_rig(
        tmp_path, SCENARIO, planner={"lease_s": 4.0, "sweep_interval_s": 1.0}
    ) as (r, net):
        session_id = await r.a.create_session(r.alice, "create-hole")
        stub = r.a.stub
        await stub.SendMessage(
            planner_service_pb2.SendMessageRequest(
                request_id="before", session_id=session_id, text="before the hole"
            ),
            metadata=r.alice,
        )

        net.silence()
        opened = time.monotonic()

        async def ends(call: object) -> float:
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call  # type: ignore[misc]
            failure = parse(raised.value)
            assert failure.code is grpc.StatusCode.UNAVAILABLE, failure
            assert failure.reason == "DATABASE_UNAVAILABLE", failure
            return time.monotonic() - started

        waits = await asyncio.gather(
            ends(
                stub.SendMessage(
                    planner_service_pb2.SendMessageRequest(
                        request_id="in-hole", session_id=session_id, text="in the hole"
                    ),
                    metadata=r.alice,
                )
            ),
            ends(
                stub.GetSession(
                    planner_service_pb2.GetSessionRequest(session_id=session_id),
                    metadata=r.alice,
                )
            ),
            ends(
                r.b.stub.GetSession(
                    planner_service_pb2.GetSessionRequest(session_id=session_id),
                    metadata=r.alice,
                )
            ),
        )
        assert max(waits) <= UNIT_TIMEOUT_S * 2 + SLACK_S, waits
        not_serving = await asyncio.gather(
            r.a.wait_health(NOT_SERVING, 10), r.b.wait_health(NOT_SERVING, 10)
        )
        await asyncio.sleep(max(0.0, HOLE_S - (time.monotonic() - opened)))

        net.heal()
        healed = time.monotonic()
        await asyncio.gather(r.a.wait_health(SERVING, 5), r.b.wait_health(SERVING, 5))
        serving_s = time.monotonic() - healed
        # Not executed after the heal: the transcript has no "in the hole" until the
        # client resends it, and then exactly once.
        texts = [m.text for m in await r.a.messages(r.alice, session_id)]
        assert "in the hole" not in texts
        assert "before the hole" in texts
        resent = await stub.SendMessage(
            planner_service_pb2.SendMessageRequest(
                request_id="in-hole", session_id=session_id, text="in the hole"
            ),
            metadata=r.alice,
            timeout=10,
        )
        acknowledged_s = time.monotonic() - healed
        assert resent is not None
        texts = [m.text for m in await r.a.messages(r.alice, session_id)]
        assert texts.count("in the hole") == 1 and texts.count("before the hole") == 1
        print(
            f"\nrpcs in a hole: ended in {min(waits):.2f}-{max(waits):.2f} s (deadline "
            f"{UNIT_TIMEOUT_S:g} s); NOT_SERVING after {max(not_serving):.1f} s; SERVING "
            f"{serving_s:.2f} s and a resend acknowledged {acknowledged_s:.2f} s after "
            "the heal"
        )
