"""Retention across two replicas on one PostgreSQL (docs/retention.md; decision 0251).

Two ``ballet-planner serve`` processes run the background retention job (a pass at start,
then every second). Sessions are planted through the store as if their last activity
were long ago: each has a turn that is running while Chat streams on both replicas
attach to it (a session with a running turn is never deleted), and then ends, stored
with its old time. The next pass deletes the idle sessions, and every stream attached
to them ends ``NOT_FOUND``, on the replica that deleted them (its own hook) and on the
other (the store's notification), as after ``DeleteSession``. A session in use, with
streams on both replicas, is left with its streams.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import grpc
import pytest

from service.adapters.store import SqlSessionStore, make_engine
from tests.integration.store_support import end_commit, new_session, turn_start
from tests.pg import PgServer
from tests.replicas.support import ChatStream, Rig, rig
from tests.service.planner_support import reason_of

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

LONG_AGO = datetime(2025, 1, 6, 9, 30, tzinfo=UTC)
SCENARIO = {"rules": [{"match": {"last_role": "human"}, "reply": {"text": "still here"}}]}
#: A pass every second; a deletion reaches the other replica's streams within 1 s more.
ENDED_WITHIN_S = 15.0


@pytest.fixture
async def replicas(
    pg_cluster: PgServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Rig]:
    name = f"test_{uuid.uuid4().hex[:16]}"
    pg_cluster.create_database(name)
    retention = {"session_idle_days": 30, "interval_s": 1, "batch_pause_s": 0}
    try:
        async with rig(
            tmp_path_factory.mktemp("retention"),
            pg_cluster.url(name),
            SCENARIO,
            more_tables={"retention": retention},
        ) as started:
            yield started
    finally:
        pg_cluster.drop_database(name)


async def test_idle_sessions_go_and_their_streams_end_not_found_on_both_replicas(
    replicas: Rig,
) -> None:
    r = replicas
    engine = make_engine(r.database_url)
    planter = SqlSessionStore(engine, "planter")
    idle = [f"idle-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    try:
        for session_id in idle:
            await planter.create_session(
                new_session(session_id, owner="alice", project="demo", now=LONG_AGO)
            )
            # Running, with a lease nobody sweeps: the passes leave it alone for now.
            await planter.start_turn(
                turn_start(
                    session_id,
                    f"{session_id}-t",
                    human="alice",
                    project="demo",
                    owner="planter",
                    now=LONG_AGO,
                    lease=timedelta(days=3650),
                )
            )
        active = await r.a.create_session(r.alice, f"active-{uuid.uuid4().hex}")
        streams: dict[str, list[ChatStream]] = {}
        for session_id in [*idle, active]:
            pair = [ChatStream.open(r.a, r.alice), ChatStream.open(r.b, r.alice)]
            for stream in pair:
                stream.attach(session_id)
            await asyncio.gather(*(stream.opened() for stream in pair))
            streams[session_id] = pair
        assert await planter.get_session(idle[0]) is not None

        for session_id in idle:
            await planter.commit(
                end_commit(session_id, f"{session_id}-t", now=LONG_AGO, owner="planter")
            )

        for session_id in idle:
            for stream in streams[session_id]:
                await asyncio.wait_for(stream.ended.wait(), ENDED_WITHIN_S)
                assert stream.error is not None
                assert stream.error.code() == grpc.StatusCode.NOT_FOUND, stream.error
                assert reason_of(stream.error) == "SESSION_NOT_FOUND"
            assert await planter.get_session(session_id) is None
        # The session in use keeps its streams, which still carry its turns.
        on_a, on_b = streams[active]
        assert not on_a.ended.is_set() and not on_b.ended.is_set()
        on_b.say("are you there?", "still-1")
        accepted = await on_b.wait_kind("message_accepted")
        await on_a.turn_ended(accepted.response.turn_id)
        deleted_by = [p.name for p in (r.a, r.b) if "retention: deleted" in p.log_text()]
        assert deleted_by, "one of the replicas logs the deletion"
        for pair in streams.values():
            for stream in pair:
                await stream.close()
    finally:
        await engine.dispose()
