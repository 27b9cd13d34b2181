"""``StreamRegistry`` on the real ``SqlStreamStore`` (PostgreSQL and SQLite): admission
against the per-human limit, healing after its replica's rows were swept during a lapse
(docs/decisions/0080-cross-replica-stream-count.md), slots released at any point of
their admission, and rows without a stream removed by the heartbeat (decision 0182)."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from service.adapters.store.streams import SqlStreamStore
from service.core.errors import ResourceExhausted
from service.core.ports import OpenStream
from service.core.streams import StreamRegistry, StreamSlot


class WallClock:
    """The ``Clock`` port on the machine's clocks."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()


async def until(check: Callable[[], Awaitable[bool]], seconds: float = 5.0) -> None:
    """Poll ``check`` (the count has no event to await), bounded."""
    deadline = time.monotonic() + seconds
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def admitted(registry: StreamRegistry, human_id: str) -> StreamSlot:
    slot = registry.open(human_id)
    await slot.admitted()
    return slot


async def test_streams_swept_during_a_lapse_are_counted_again(
    engine: AsyncEngine, streams: SqlStreamStore
) -> None:
    store = streams
    registry = StreamRegistry(
        store, WallClock(), "replica-a", per_human=3, lease_s=0.3, sweep_interval_s=0.05
    )
    await registry.start()
    try:
        first = await admitted(registry, "alice")
        await admitted(registry, "alice")
        # Another replica, seeing this one's lease as lapsed, sweeps its rows away...
        assert await store.sweep_replicas(datetime.now(UTC) + timedelta(seconds=10)) == 1
        assert await store.count_streams("alice", datetime.now(UTC)) == 0
        # ...an open now re-registers the replica (and restores the two) before it counts.
        await admitted(registry, "alice")
        assert await store.count_streams("alice", datetime.now(UTC)) == 3
        with pytest.raises(ResourceExhausted) as caught:
            await admitted(registry, "alice")
        assert caught.value.reason == "TOO_MANY_STREAMS"
        # Swept again: this time the heartbeat loop notices and restores them.
        await store.sweep_replicas(datetime.now(UTC) + timedelta(seconds=10))

        async def restored() -> bool:
            return await store.count_streams("alice", datetime.now(UTC)) == 3

        await until(restored)
        # A stream that ends gives its place back.
        first.release()

        async def freed() -> bool:
            return await store.count_streams("alice", datetime.now(UTC)) == 2

        await until(freed)
    finally:
        await registry.stop()
    assert await store.count_streams("alice", datetime.now(UTC)) == 0


async def test_streams_released_at_any_point_of_their_admission_leave_no_row(
    streams: SqlStreamStore,
) -> None:
    """A Chat RPC cancelled while its slot is being taken releases it from its done
    callback; whether the admission had not started, was in flight or had finished, no
    row stays (decision 0182)."""
    registry = StreamRegistry(streams, WallClock(), "replica-a", per_human=1000)
    await registry.start()
    rng = random.Random(12)
    try:
        callers: list[asyncio.Task[None]] = []
        for _ in range(200):
            slot = registry.open("alice")
            caller = asyncio.get_running_loop().create_task(slot.admitted())
            callers.append(caller)
            for _ in range(rng.randrange(8)):
                await asyncio.sleep(0)
            caller.cancel()
            slot.release()
        await asyncio.gather(*callers, return_exceptions=True)
        await registry.settle()
        assert await streams.count_streams("alice", datetime.now(UTC)) == 0
        assert await streams.replica_streams("replica-a") == []
        assert registry.open_here == 0
    finally:
        await registry.stop()


async def test_a_row_without_a_stream_is_removed_at_the_next_heartbeat(
    streams: SqlStreamStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever leaves a row behind (nothing should), the heartbeat removes it within
    one interval and keeps the rows of streams still open (decision 0182)."""
    registry = StreamRegistry(
        streams, WallClock(), "replica-a", per_human=16, lease_s=3.0, sweep_interval_s=0.05
    )
    await registry.start()
    try:
        live = await admitted(registry, "alice")
        leaked = OpenStream(uuid.uuid4().hex, "alice", "replica-a", datetime.now(UTC))
        assert await streams.open_stream(leaked, limit=16, now=datetime.now(UTC))

        async def reaped() -> bool:
            return await streams.replica_streams("replica-a") == [live.stream_id]

        await until(reaped)
        assert "1 stream rows without an open stream here" in caplog.text
        live.release()
        await registry.settle()
        assert await streams.replica_streams("replica-a") == []
    finally:
        await registry.stop()
