"""A turn's start whose commit landed while its reply was lost (decision 0372).

The ambiguous commit is made with a real PostgreSQL: the cluster names a synchronous
standby that never connects, so a commit with ``synchronous_commit = on`` is written
locally and then waits for the standby; the test terminates the backend that waits, and
PostgreSQL ends the wait with the transaction committed ("the transaction has already
committed locally"). The planner sees a broken connection (``UNAVAILABLE`` to the
sender) while the turn's row says RUNNING, owned by it. A failover to a synchronous
standby makes the same window (``tests/replicas/test_failover.py``).

Before 0372 nothing ran that turn: it held its session (``TURN_IN_PROGRESS``) until its
lease expired and a sweeper closed it. Now the planner reads back a start it could not
confirm and runs the turn it finds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import psycopg
import pytest
from ballet.planner.v1 import chat_pb2, resources_pb2

from ballet_common.grpc.status import from_status
from tests.pg import PgCluster
from tests.service.turn_support import Rig, start_rig, stop_rig

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

END = resources_pb2.TurnEndReason
#: Far longer than the test: a turn left to its lease holds its session throughout.
LEASE_S = 300


@pytest.fixture
async def rig(
    tmp_path_factory: pytest.TempPathFactory, own_pg_cluster: PgCluster
) -> AsyncIterator[Rig]:
    own_pg_cluster.create_database("planner")
    with psycopg.connect(own_pg_cluster.admin_url(), autocommit=True) as conn:
        # Only the planner's database waits for a synchronous standby when one is named.
        conn.execute("ALTER DATABASE planner SET synchronous_commit = on")
    started = await start_rig(
        tmp_path_factory.mktemp("unsure-start"),
        database_url=own_pg_cluster.url("planner"),
        settings={"PLANNER__LEASE_S": str(LEASE_S), "PLANNER__SWEEP_INTERVAL_S": "1"},
    )
    try:
        yield started
    finally:
        await stop_rig(started)


async def _standby_required(admin: psycopg.AsyncConnection, names: str | None) -> None:
    """Name a synchronous standby that never comes (``names``), or none (None); returns
    once the server applies it."""
    if names is None:
        await admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
    else:
        await admin.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
    await admin.execute("SELECT pg_reload_conf()")
    for _ in range(100):
        cursor = await admin.execute("SHOW synchronous_standby_names")
        row = await cursor.fetchone()
        if row is not None and row[0] == (names or ""):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the server did not apply synchronous_standby_names")


async def _terminate_the_waiting_start(admin: psycopg.AsyncConnection) -> None:
    """Wait until the start's commit waits for the standby, then end its backend."""
    for _ in range(200):
        cursor = await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE wait_event = 'SyncRep' AND query LIKE '%planner_start_turn%'"
        )
        if await cursor.fetchall():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the start's commit never waited for the standby")


def accepted_for(response: chat_pb2.ChatResponse, request_id: str) -> bool:
    """Whether ``response`` is the ``message_accepted`` answering ``request_id``."""
    return response.HasField("message_accepted") and response.request_id == request_id


async def test_a_start_committed_without_its_reply_runs_its_turn(
    rig: Rig, own_pg_cluster: PgCluster
) -> None:
    rig.scenario([{"match": {"last_role": "human"}, "reply": {"text": "Ran all the same."}}])
    session_id = (await rig.create_session()).session_id
    admin = await psycopg.AsyncConnection.connect(
        own_pg_cluster.url("planner").replace("+psycopg", ""), autocommit=True
    )
    try:
        async with rig.chat() as stream:
            await stream.open(session_id)
            await stream.opened()
            await _standby_required(admin, "no_such_standby")
            await stream.send("Plan the week.", "unsure-1")
            await _terminate_the_waiting_start(admin)
            await _standby_required(admin, None)
            refused = await stream.until_kind("error")
            info = from_status(refused[-1].error)
            assert info is not None and info.reason == "DATABASE_UNAVAILABLE", refused

            # The start did commit: its turn runs to the end here (``ended_turn`` waits
            # 15 s at most, the lease is 300 s).
            cursor = await admin.execute(
                "SELECT turn_id FROM turns WHERE session_id = %s AND request_id = 'unsure-1'",
                (session_id,),
            )
            row = await cursor.fetchone()
            assert row is not None, "the start was not committed: the test made no ambiguity"
            turn_id = row[0]
            turn = await rig.ended_turn(session_id, turn_id)
            assert turn.end_reason == END.TURN_END_REASON_COMPLETED, turn
            # The stream shows the turn to its end; a retry of the message is that turn, a
            # next message starts another.
            await stream.until(lambda r: r.turn_id == turn_id and r.HasField("turn_ended"))
            await stream.send("Plan the week.", "unsure-1")
            retried = await stream.until(lambda r: accepted_for(r, "unsure-1"))
            assert retried[-1].turn_id == turn_id
            await stream.send("And the next.", "unsure-2")
            accepted = await stream.until(lambda r: accepted_for(r, "unsure-2"))
            assert accepted[-1].turn_id != turn_id
            await stream.until(
                lambda r: r.turn_id == accepted[-1].turn_id and r.HasField("turn_ended")
            )
    finally:
        await admin.close()
    messages = await rig.transcript(session_id)
    assert [m.text for m in messages if m.text] == [
        "Plan the week.",
        "Ran all the same.",
        "And the next.",
        "Ran all the same.",
    ], messages
