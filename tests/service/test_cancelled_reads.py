"""Reads whose RPC was cancelled give their connections back (decision 0236).

A planner on PostgreSQL with a SQLAlchemy pool of 20 connections (10 + 10 overflow).
Another connection locks the transcript table; 20 ``ListMessages`` calls wait behind it
and their clients give up (a deadline). While the lock is still held, ``ListSessions``
(which reads no transcript) gets a connection and answers: the abandoned reads were
cancelled on the server ``database.abandoned_read_grace_s`` after their RPCs ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import psycopg
import pytest
from ballet.planner.v1 import planner_service_pb2 as pb
from ballet.planner.v1 import planner_service_pb2_grpc
from psycopg import pq

from service.adapters.store import migrate
from service.server.root import start_planner
from tests.service.planner_support import FakeTracker, auth, planner_settings, token

pytestmark = pytest.mark.postgres

READS = 20


@pytest.fixture
async def tracker() -> AsyncIterator[FakeTracker]:
    fake = FakeTracker(projects={"demo": ("acme", {"alice"})})
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


async def test_cancelled_list_messages_behind_a_lock_do_not_hold_the_pool(
    pg_url: str, tracker: FakeTracker, tmp_path: Path
) -> None:
    await migrate(pg_url)
    settings = planner_settings(
        tmp_path,
        tracker.address,
        pg_url,
        database__pool_size="10",
        database__max_overflow="10",
        database__pool_timeout_s="60",
        database__abandoned_read_grace_s="0.5",
    )
    app = await start_planner(settings)
    channel = grpc.aio.insecure_channel(app.address)
    libpq = pg_url.replace("postgresql+psycopg://", "postgresql://")
    try:
        stub = planner_service_pb2_grpc.PlannerServiceStub(channel)
        alice = auth(token(tmp_path, "alice"))
        created = await stub.CreateSession(
            pb.CreateSessionRequest(request_id="create-1", project_id="demo"),
            metadata=alice,
            timeout=10,
        )
        session_id = created.session.session_id
        async with await psycopg.AsyncConnection.connect(libpq) as locker:
            await locker.execute("LOCK TABLE messages IN ACCESS EXCLUSIVE MODE")
            calls = [
                stub.ListMessages(
                    pb.ListMessagesRequest(session_id=session_id), metadata=alice, timeout=2
                )
                for _ in range(READS)
            ]
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            assert all(
                isinstance(o, grpc.aio.AioRpcError)
                and o.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                for o in outcomes
            ), outcomes
            listed = await stub.ListSessions(
                pb.ListSessionsRequest(project_id="demo"), metadata=alice, timeout=10
            )
            assert [s.session_id for s in listed.sessions] == [session_id]
            assert locker.info.transaction_status == pq.TransactionStatus.INTRANS
            await locker.rollback()
    finally:
        await channel.close()
        await app.stop(0)
