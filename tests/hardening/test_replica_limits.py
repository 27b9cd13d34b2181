"""The per-human limits hold across replicas (docs/spec/limits.md): two
planners on one PostgreSQL database share one count of a human's open Chat streams and
running turns; the streams of a replica killed with SIGKILL stop counting once its
lease lapses, and are swept (docs/decisions/0080-cross-replica-stream-count.md)."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from ballet.planner.v1 import planner_service_pb2 as pb
from ballet.planner.v1 import planner_service_pb2_grpc
from sqlalchemy import func, select

from service.adapters.store import make_engine
from service.adapters.store.streams import SqlStreamStore
from service.adapters.store.tables import chat_streams
from tests.hardening.support import (
    Chat,
    Planner,
    Stack,
    create_session,
    eventually,
    failure,
    open_request,
    refused,
    send_request,
    serve_process,
    start_stack,
)

pytestmark = pytest.mark.postgres

HOLD_RULES = [{"reply": {"text": "slow", "delay_ms": 60_000}}]


@pytest.fixture
async def stack(tmp_path: Path, pg_url: str) -> AsyncIterator[Stack]:
    started = await start_stack(tmp_path / "data", HOLD_RULES, database_url=pg_url)
    try:
        yield started
    finally:
        await started.stop()


async def refused_stream(planner: Planner, stack: Stack) -> tuple[grpc.StatusCode, str]:
    """The status of a stream that opens a session (its slot is taken at open)."""
    chat = Chat(planner.stub, stack.auth())
    await chat.send(open_request(project_id="demo"))
    error = await chat.ended()
    assert error is not None
    code, reason, _ = failure(error)
    return code, reason


async def test_open_streams_are_counted_across_replicas(stack: Stack) -> None:
    a = await stack.planner("replica-a")
    b = await stack.planner("replica-b")
    streams = []
    for index in range(16):
        chat = Chat((a if index % 2 else b).stub, stack.auth())
        await chat.open()
        streams.append(chat)
    for planner in (a, b):
        assert await refused_stream(planner, stack) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "TOO_MANY_STREAMS",
        )
    # A stream ending on A frees a place that B can use.
    await streams.pop(0).close()

    async def admitted_on_b() -> bool:
        chat = Chat(b.stub, stack.auth())
        try:
            await chat.open()
        except grpc.aio.AioRpcError:
            return False
        streams.append(chat)
        return True

    await eventually(admitted_on_b)
    for chat in streams:
        chat.cancel()


async def test_running_turns_of_one_human_are_counted_across_replicas(stack: Stack) -> None:
    a = await stack.planner("replica-a")
    b = await stack.planner("replica-b")
    alice = stack.auth()
    for index, planner in enumerate((a, a, b, b)):
        chat = Chat(planner.stub, alice)
        await chat.open()
        await chat.send(send_request("hold on", f"held-{index}"))
        await chat.until("turn_started")
        chat.cancel()
    for planner in (a, b):
        session = await create_session(planner, alice, f"fifth-{id(planner)}")
        code, reason, _ = await refused(
            planner.stub.SendMessage(
                pb.SendMessageRequest(session_id=session, text="more", request_id="m"),
                metadata=alice,
            )
        )
        assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_TURNS")


@pytest.mark.slow
async def test_streams_of_a_killed_replica_stop_counting_when_its_lease_lapses(
    stack: Stack, tmp_path: Path
) -> None:
    lease = {"PLANNER__LEASE_S": "2", "PLANNER__SWEEP_INTERVAL_S": "0.5"}
    killed = await serve_process(stack, tmp_path / "a.log", SERVER__REPLICA_ID="doomed", **lease)
    b = await stack.planner("replica-b", **lease)
    channel = grpc.aio.insecure_channel(killed.address)
    try:
        stub = planner_service_pb2_grpc.PlannerServiceStub(channel)
        streams = []
        for _ in range(16):
            chat = Chat(stub, stack.auth())
            await chat.open()
            streams.append(chat)
        assert await refused_stream(b, stack) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "TOO_MANY_STREAMS",
        )
        killed.process.send_signal(signal.SIGKILL)
        killed.process.wait(10)
        # Its rows are still there, but stop counting once its 2 s lease lapses...
        opened = Chat(b.stub, stack.auth())

        async def admitted() -> bool:
            nonlocal opened
            opened = Chat(b.stub, stack.auth())
            try:
                await opened.open()
            except grpc.aio.AioRpcError:
                return False
            return True

        await eventually(admitted, seconds=10)
        # ...and B's sweep deletes them, leaving only B's own stream.
        engine = make_engine(stack.database_url, pool_size=1)
        try:

            async def swept() -> bool:
                async with engine.connect() as conn:
                    count = (
                        await conn.execute(select(func.count()).select_from(chat_streams))
                    ).scalar_one()
                return int(count) == 1

            await eventually(swept, seconds=10)
            assert await SqlStreamStore(engine).count_streams("alice", datetime.now(UTC)) == 1
        finally:
            await engine.dispose()
        opened.cancel()
    finally:
        await channel.close()
        killed.stop()
