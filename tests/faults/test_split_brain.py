"""Split brain, for real (decisions 0314 and 0315): replica A is cut from the database
by DROP rules while B still reaches it, and A's Chat clients still reach A.

A's client has its stream ended ``UNAVAILABLE``/``REPLICA_UNAVAILABLE`` within the lease
plus 10 s, with the ``last_sequence`` it got; it reopens on B with that
``after_sequence``, misses nothing and gets nothing twice, and its next message runs on
B. A reports NOT_SERVING during the cut and SERVING at once after it. Bounds are
shortened by configuration (a 4 s lease, a 3 s unit deadline, a 2 s TCP user timeout).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from tests.faults.rigs import DATABASE as DATABASE
from tests.faults.rigs import let_go, silent_rig
from tests.replicas.support import ChatStream, sequences

pytestmark = pytest.mark.postgres

LEASE_S = 4.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SCENARIO = {"rules": [{"match": {"last_role": "human"}, "reply": {"text": "Noted."}}]}


async def test_the_cut_replica_lets_its_clients_go_and_they_resume_on_the_other(
    tmp_path: Path,
) -> None:
    async with silent_rig(
        tmp_path, SCENARIO, planner={"lease_s": LEASE_S, "sweep_interval_s": 1.0}, split=True
    ) as (r, net):
        session_id = await r.a.create_session(r.alice, "create-split")
        first = await ChatStream.opened_on(r.a, r.alice, session_id)
        await first.turn_ended(await first.accepted("before the cut", "m1"))

        net.cut(net.inner_ip)  # A's way to the database only
        cut_at = time.monotonic()
        not_serving_s = await r.a.wait_health(NOT_SERVING, 10)
        async with asyncio.timeout(LEASE_S + 10):
            await first.ended.wait()
        ended_s = time.monotonic() - cut_at
        last = let_go(first, session_id)

        # The gateway's move: reopen on B after what it got.
        second = await ChatStream.opened_on(r.b, r.alice, session_id, last)
        await second.turn_ended(await second.accepted("after the cut", "m2"))
        resumed = sequences(second.events())
        assert resumed[0] == last + 1 and resumed == list(range(last + 1, resumed[-1] + 1))

        net.mend(net.inner_ip)
        back_s = await r.a.wait_health(SERVING, 5)
        await second.close()
        print(
            f"\nsplit brain: A NOT_SERVING after {not_serving_s:.1f} s, its stream ended "
            f"after {ended_s:.1f} s (lease {LEASE_S:g} s); A SERVING {back_s:.2f} s "
            "after the heal"
        )
