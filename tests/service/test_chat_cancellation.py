"""A Chat RPC cancelled while its stream registers, or again during its clean-up, leaves
no ``chat_streams`` row and no queue behind (decision 0182).

A planner on SQLite with the devstack; its stream store is the real one behind
``HeldStreamStore``, a double that holds a stream's admission after its row is committed
and before the answer returns, until the test lets it go: the client's cancel lands
exactly where a cancelled registration used to leave its row behind. A client cannot
cancel a call twice, so the second scenario drives the Chat servicer's handler as gRPC
does (an async generator consumed by a task) and cancels that task twice: once while it
streams, once where its clean-up awaits.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from ballet.planner.v1 import chat_pb2, planner_service_pb2_grpc

from service.core.ports import OpenStream, StreamStore
from service.server.root import PlannerApp, start_planner
from service.server.wiring import PlannerTurns, Wiring, build_turns
from service.transport.auth import Authenticator
from service.transport.chat import chat
from tests.hardening.support import Stack, eventually, open_request, start_stack
from tests.service.planner_support import auth, planner_settings


class HeldStreamStore:
    """The real ``StreamStore`` (``inner``), except that ``open_stream``, once its row is
    committed, waits while ``held`` until ``let_go`` before it answers; ``entered`` is
    set once an admission waits."""

    def __init__(self, inner: StreamStore) -> None:
        self.inner = inner
        self.held = False
        self.entered = asyncio.Event()
        self._go = asyncio.Event()

    def hold(self) -> None:
        self.held, self.entered, self._go = True, asyncio.Event(), asyncio.Event()

    def let_go(self) -> None:
        self.held = False
        self._go.set()

    async def open_stream(self, stream: OpenStream, *, limit: int, now: datetime) -> bool:
        admitted = await self.inner.open_stream(stream, limit=limit, now=now)
        if self.held:
            # The row is committed; the answer has not reached the caller yet.
            self.entered.set()
            await self._go.wait()
        return admitted

    async def heartbeat(self, replica_id: str, lease_expires_at: datetime) -> bool:
        return await self.inner.heartbeat(replica_id, lease_expires_at)

    async def close_streams(self, stream_ids: Sequence[str]) -> None:
        await self.inner.close_streams(stream_ids)

    async def restore_streams(self, replica_id: str, streams: Sequence[OpenStream]) -> None:
        await self.inner.restore_streams(replica_id, streams)

    async def replica_streams(self, replica_id: str) -> list[str]:
        return await self.inner.replica_streams(replica_id)

    async def remove_replica(self, replica_id: str) -> None:
        await self.inner.remove_replica(replica_id)

    async def sweep_replicas(self, now: datetime) -> int:
        return await self.inner.sweep_replicas(now)


@dataclasses.dataclass
class Planner:
    app: PlannerApp
    turns: PlannerTurns
    streams: HeldStreamStore
    authenticator: Authenticator
    channel: grpc.aio.Channel
    stub: planner_service_pb2_grpc.PlannerServiceStub

    async def no_stream_left(self) -> None:
        """No admission or delete in flight, no row, no queue, the gauge at 0."""
        registry = self.turns.streams
        assert registry is not None
        await registry.settle()
        assert await self.streams.replica_streams(self.app.settings.server.replica_id) == []
        assert registry.open_here == registry.admitting_here == 0
        assert self.turns.hub.stream_count() == 0
        assert self.app.metrics.registry.get_sample_value("ballet_planner_open_streams") == 0


@pytest.fixture
async def planner(tmp_path: Path) -> AsyncIterator[tuple[Stack, Planner]]:
    stack = await start_stack(tmp_path / "data")
    built: list[tuple[PlannerTurns, HeldStreamStore, Authenticator]] = []

    def machinery(wiring: Wiring) -> PlannerTurns:
        assert wiring.streams is not None
        held = HeldStreamStore(wiring.streams)
        turns = build_turns(dataclasses.replace(wiring, streams=held))
        built.append((turns, held, wiring.authenticator))
        return turns

    settings = planner_settings(stack.data_dir, stack.devstack.address)
    app = await start_planner(settings, turn_machinery=machinery)
    channel = grpc.aio.insecure_channel(app.address)
    turns, held, authenticator = built[0]
    stub = planner_service_pb2_grpc.PlannerServiceStub(channel)
    try:
        yield stack, Planner(app, turns, held, authenticator, channel, stub)
    finally:
        held.let_go()
        await channel.close()
        await app.stop(0)
        await stack.stop()


async def test_a_chat_cancelled_while_its_stream_registers_leaves_no_row(
    planner: tuple[Stack, Planner],
) -> None:
    stack, p = planner
    registry = p.turns.streams
    assert registry is not None
    p.streams.hold()
    call = p.stub.Chat(metadata=stack.auth())
    writing = asyncio.ensure_future(call.write(open_request(project_id="demo")))
    await asyncio.wait_for(p.streams.entered.wait(), 15)
    assert registry.admitting_here == 1
    call.cancel()
    writing.cancel()

    # The RPC ended while its admission still waited: its done callback released it.
    async def released() -> bool:
        return registry.admitting_here == 0

    await eventually(released)
    assert len(await p.streams.inner.replica_streams(p.app.settings.server.replica_id)) == 1
    p.streams.let_go()  # the admission learns it stored a row, and deletes it again
    await p.no_stream_left()
    # The human's slots are all free: a stream opens and works.
    follow = p.stub.Chat(metadata=stack.auth())
    await follow.write(open_request(project_id="demo"))
    opened = await asyncio.wait_for(follow.read(), 15)
    assert opened.WhichOneof("event") == "session_opened"
    follow.cancel()


class HandlerContext:
    """What the Chat servicer uses of a ``grpc.aio.ServicerContext``: the call's
    metadata, done callbacks (which gRPC runs when the RPC's task is done) and abort."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)
        self.callbacks: list[Callable[[Any], None]] = []

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self.callbacks.append(callback)

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: Any = ()) -> None:
        raise grpc.aio.AbortError(details)


async def test_a_chat_cancelled_again_during_its_clean_up_leaves_nothing_behind(
    planner: tuple[Stack, Planner],
) -> None:
    stack, p = planner
    never = asyncio.Event()

    async def requests() -> AsyncIterator[chat_pb2.ChatRequest]:
        yield open_request(project_id="demo")
        await never.wait()

    context = HandlerContext(auth(stack.devstack.token("alice")))
    opened = asyncio.Event()

    async def handler() -> None:
        # What gRPC does with a stream-stream handler: iterate it, send each response.
        responses = chat(p.turns.chat, p.authenticator, requests(), context)  # type: ignore[arg-type]
        async for response in responses:
            if response.WhichOneof("event") == "session_opened":
                opened.set()

    task = asyncio.get_running_loop().create_task(handler())
    await asyncio.wait_for(opened.wait(), 15)
    assert p.turns.hub.stream_count() == 1
    task.cancel()
    # One step: the handler runs its clean-up up to its first await...
    await asyncio.sleep(0)
    # ...where the second cancellation lands.
    task.cancel()
    await asyncio.wait({task})
    assert task.cancelled()
    # Everything that must follow the stream happened before that await: no done
    # callback has run here, and nothing is left.
    await p.no_stream_left()
    for callback in context.callbacks:
        callback(context)  # idempotent when gRPC runs them after all
    await p.no_stream_left()
