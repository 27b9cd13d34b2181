"""``SqlStreamStore``: open Chat streams counted per human across replicas (docs/spec/limits.md and
docs/decisions/0080-cross-replica-stream-count.md), on PostgreSQL and SQLite."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from service.adapters.store.streams import SqlStreamStore
from service.adapters.store.tables import chat_streams
from service.core.errors import StoreConflict
from service.core.ports import OpenStream

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
LEASE = NOW + timedelta(seconds=15)


def stream(human: str, replica: str, stream_id: str | None = None) -> OpenStream:
    return OpenStream(stream_id or uuid.uuid4().hex, human, replica, NOW)


async def rows(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int(
            (await conn.execute(select(func.count()).select_from(chat_streams))).scalar_one()
        )


async def test_the_limit_holds_per_human_across_replicas(
    engine: AsyncEngine, streams: SqlStreamStore
) -> None:
    store = streams
    assert await store.heartbeat("a", LEASE) is False
    assert await store.heartbeat("b", LEASE) is False
    assert await store.heartbeat("a", LEASE) is True
    for index in range(3):
        assert await store.open_stream(stream("alice", "ab"[index % 2]), limit=3, now=NOW)
    assert not await store.open_stream(stream("alice", "b"), limit=3, now=NOW)
    assert await store.open_stream(stream("bob", "b"), limit=3, now=NOW)
    assert await store.count_streams("alice", NOW) == 3


async def test_concurrent_opens_admit_exactly_the_limit(
    engine: AsyncEngine, streams: SqlStreamStore
) -> None:
    store = streams
    for replica in ("a", "b"):
        await store.heartbeat(replica, LEASE)
    results = await asyncio.gather(
        *(store.open_stream(stream("alice", "ab"[i % 2]), limit=16, now=NOW) for i in range(40))
    )
    assert results.count(True) == 16
    assert await rows(engine) == 16


async def test_a_lapsed_replica_stops_counting_and_is_swept_with_its_streams(
    engine: AsyncEngine,
    streams: SqlStreamStore,
) -> None:
    store = streams
    await store.heartbeat("dead", NOW + timedelta(seconds=1))
    await store.heartbeat("live", LEASE)
    for _ in range(2):
        assert await store.open_stream(stream("alice", "dead"), limit=2, now=NOW)
    assert not await store.open_stream(stream("alice", "live"), limit=2, now=NOW)
    later = NOW + timedelta(seconds=2)
    # The dead replica's lease lapsed: its streams no longer count, before any sweep.
    assert await store.count_streams("alice", later) == 0
    assert await store.open_stream(stream("alice", "live"), limit=2, now=later)
    assert await store.sweep_replicas(later) == 1
    assert await rows(engine) == 1
    # The swept replica's next open fails on its foreign key; a heartbeat re-registers it.
    with pytest.raises(StoreConflict):
        await store.open_stream(stream("alice", "dead"), limit=2, now=later)
    assert await store.heartbeat("dead", later + timedelta(seconds=15)) is False


async def test_restore_close_and_remove(engine: AsyncEngine, streams: SqlStreamStore) -> None:
    store = streams
    await store.heartbeat("a", LEASE)
    kept = stream("alice", "a", "s1")
    assert await store.open_stream(kept, limit=5, now=NOW)
    # Restoring keeps rows that exist and adds the missing ones.
    await store.restore_streams("a", [kept, stream("alice", "a", "s2")])
    assert await store.count_streams("alice", NOW) == 2
    await store.close_streams(["s1", "unknown"])
    assert await store.count_streams("alice", NOW) == 1
    await store.remove_replica("a")
    assert await rows(engine) == 0
