"""``StreamRegistry`` on the real ``SqlStreamStore`` (PostgreSQL and SQLite): admission
against the per-human limit, and healing after its replica's rows were swept during a
lapse (docs/decisions/0080-cross-replica-stream-count.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from service.adapters.store.streams import SqlStreamStore
from service.core.errors import ResourceExhausted
from service.core.streams import StreamRegistry


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


async def test_streams_swept_during_a_lapse_are_counted_again(
    engine: AsyncEngine, streams: SqlStreamStore
) -> None:
    store = streams
    registry = StreamRegistry(
        store, WallClock(), "replica-a", per_human=3, lease_s=0.3, sweep_interval_s=0.05
    )
    await registry.start()
    try:
        first = await registry.open("alice")
        await registry.open("alice")
        # Another replica, seeing this one's lease as lapsed, sweeps its rows away...
        assert await store.sweep_replicas(datetime.now(UTC) + timedelta(seconds=10)) == 1
        assert await store.count_streams("alice", datetime.now(UTC)) == 0
        # ...an open now re-registers the replica (and restores the two) before it counts.
        await registry.open("alice")
        assert await store.count_streams("alice", datetime.now(UTC)) == 3
        with pytest.raises(ResourceExhausted) as caught:
            await registry.open("alice")
        assert caught.value.reason == "TOO_MANY_STREAMS"
        # Swept again: this time the heartbeat loop notices and restores them.
        await store.sweep_replicas(datetime.now(UTC) + timedelta(seconds=10))

        async def restored() -> bool:
            return await store.count_streams("alice", datetime.now(UTC)) == 3

        await until(restored)
        # A stream that ends gives its place back.
        registry.close(first)

        async def freed() -> bool:
            return await store.count_streams("alice", datetime.now(UTC)) == 2

        await until(freed)
    finally:
        await registry.stop()
    assert await store.count_streams("alice", datetime.now(UTC)) == 0
