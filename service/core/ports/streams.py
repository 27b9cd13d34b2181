"""Stream port: the open Chat streams of every replica, counted per human across
replicas."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol


@dataclass(frozen=True)
class OpenStream:
    """One open Chat stream as the cross-replica count sees it (docs/spec/limits.md)."""

    stream_id: str
    human_id: str
    replica_id: str
    opened_at: datetime


class StreamStore(Protocol):
    """The open Chat streams of every replica, counted per human across replicas (at
    most 16 per human, docs/spec/limits.md), as rows rather than connections: an idle stream
    costs a row, never a database connection (docs/decisions/0080-cross-replica-stream-
    count.md). A replica's rows count only while its heartbeat lease holds."""

    async def heartbeat(self, replica_id: str, lease_expires_at: datetime) -> bool:
        """Extend ``replica_id``'s lease, creating its row when missing; False when the
        row was missing (first beat, or swept after a lapse: its streams are gone)."""
        ...

    async def open_stream(self, stream: OpenStream, *, limit: int, now: datetime) -> bool:
        """Record ``stream`` unless its human already has ``limit`` streams on replicas
        whose lease holds at ``now``; False (nothing stored) when refused. The count and
        the insert are atomic across replicas."""
        ...

    async def close_streams(self, stream_ids: Sequence[str]) -> None:
        """Forget streams; unknown ids are ignored."""
        ...

    async def restore_streams(self, replica_id: str, streams: Sequence[OpenStream]) -> None:
        """Re-record a replica's open streams after its rows were swept (a lapse)."""
        ...

    async def replica_streams(self, replica_id: str) -> list[str]:
        """The ids of the streams recorded for ``replica_id`` (its heartbeat checks them
        against the streams open on it, decision 0182)."""
        ...

    async def remove_replica(self, replica_id: str) -> None:
        """Forget a replica and its streams (start-up of a reused id, shutdown)."""
        ...

    async def sweep_replicas(self, now: datetime) -> int:
        """Forget replicas whose lease expired before ``now`` and their streams; returns
        how many replicas were forgotten."""
        ...
