"""Open Chat streams per human, counted across replicas (SPEC section 8: at most 16).

``StreamRegistry`` is the replica's side of the count (docs/decisions/0080-cross-replica-
stream-count.md). Each open stream is one row in the ``StreamStore`` (stream id, human,
replica, opened at), inserted when the stream opens and deleted when it ends; the count
and the insert run in one transaction serialized per human, so two replicas opening a
human's seventeenth stream at once cannot both succeed. An idle stream holds a row, not
a database connection, timer or poll.

A replica's rows count only while its lease holds. One loop per process, every
``min(lease_s / 3, sweep_interval_s)`` seconds:

- renews this replica's lease (a heartbeat); when it finds the replica's row gone (a
  lapse long enough for another replica to sweep it, e.g. a database outage), it
  re-records every stream still open here, so the count is right again;
- retries the deletes of streams that ended while the database was unreachable;
- forgets replicas whose lease expired (a replica killed with SIGKILL) and their rows.

Start-up forgets rows a replica of the same id left in an earlier life; shutdown
forgets this replica's rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from datetime import timedelta

from service.core.errors import ResourceExhausted, StoreConflict, StoreUnavailable, Unavailable
from service.core.ports import Clock, OpenStream, StreamStore

log = logging.getLogger(__name__)

#: Seconds a client refused with TOO_MANY_STREAMS should wait (``google.rpc.RetryInfo``).
TOO_MANY_STREAMS_RETRY_S = 1.0


class StreamRegistry:
    """Admits and forgets this replica's Chat streams against the per-human limit.

    ``per_human``: streams one human may have open across replicas
    (``limits.streams_per_human``); ``lease_s``: how long a heartbeat keeps this
    replica's streams counted (``planner.lease_s``); ``sweep_interval_s``: how often
    replicas whose lease lapsed are forgotten (``planner.sweep_interval_s``). Seconds.
    """

    def __init__(
        self,
        store: StreamStore,
        clock: Clock,
        replica_id: str,
        *,
        per_human: int,
        lease_s: float = 15.0,
        sweep_interval_s: float = 5.0,
    ) -> None:
        self._store = store
        self._clock = clock
        self._replica = replica_id
        self._per_human = per_human
        self._lease_s = lease_s
        self._interval_s = min(lease_s / 3, sweep_interval_s)
        self._open: dict[str, OpenStream] = {}
        self._unclosed: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None

    @property
    def open_here(self) -> int:
        """Streams open on this replica."""
        return len(self._open)

    async def start(self) -> None:
        """Forget what a replica of this id left behind, register this one, and start the
        heartbeat loop. A database that is down now is retried by the loop."""
        try:
            await self._store.remove_replica(self._replica)
            await self._beat()
        except StoreUnavailable:
            log.warning("stream registry: database unavailable at start; retrying")
        self._loop_task = asyncio.get_running_loop().create_task(
            self._run(), name="stream-registry"
        )

    async def stop(self) -> None:
        """Stop the loop and forget this replica's rows (best effort: if the database is
        down, the lease lapses and another replica sweeps them)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(StoreUnavailable):
            await self._store.remove_replica(self._replica)
        self._open.clear()
        self._unclosed.clear()

    async def open(self, human_id: str) -> str:
        """Admit one stream of ``human_id``; returns its id, for ``close``.

        Raises ``ResourceExhausted``/``TOO_MANY_STREAMS`` (with ``retry_after_s``) when
        the human already has ``per_human`` streams open on live replicas (SPEC 8), and
        ``Unavailable``/``DATABASE_UNAVAILABLE`` when the count cannot be read.
        """
        stream = OpenStream(
            stream_id=uuid.uuid4().hex,
            human_id=human_id,
            replica_id=self._replica,
            opened_at=self._clock.now(),
        )
        try:
            try:
                admitted = await self._store.open_stream(
                    stream, limit=self._per_human, now=stream.opened_at
                )
            except StoreConflict:
                # This replica's row was swept after a lapse: register again, then retry.
                await self._beat()
                admitted = await self._store.open_stream(
                    stream, limit=self._per_human, now=stream.opened_at
                )
        except StoreUnavailable as error:
            raise Unavailable(
                "the database is unavailable", reason="DATABASE_UNAVAILABLE"
            ) from error
        if not admitted:
            raise ResourceExhausted(
                f"at most {self._per_human} open Chat streams per human; close one first",
                reason="TOO_MANY_STREAMS",
                retry_after_s=TOO_MANY_STREAMS_RETRY_S,
            )
        self._open[stream.stream_id] = stream
        return stream.stream_id

    def close(self, stream_id: str) -> None:
        """Forget a stream that ended. Never waits and never fails: the delete runs in
        the background (so a cancelled RPC cannot interrupt it), and a delete the
        database refused is retried by the heartbeat loop."""
        if self._open.pop(stream_id, None) is None:
            return
        task = asyncio.get_running_loop().create_task(self._delete([stream_id]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _delete(self, stream_ids: list[str]) -> None:
        try:
            await self._store.close_streams(stream_ids)
        except Exception as error:
            self._unclosed.update(stream_ids)
            if not isinstance(error, StoreUnavailable):
                log.exception("stream registry: closing streams failed")

    async def _beat(self) -> None:
        until = self._clock.now() + timedelta(seconds=self._lease_s)
        if not await self._store.heartbeat(self._replica, until):
            # The row was missing: first beat, or another replica swept this one after a
            # lapse and took its streams with it. Count the streams open here again.
            streams = list(self._open.values())
            if streams:
                log.warning(
                    "stream registry: lease lapsed; re-recording %d open streams", len(streams)
                )
                await self._store.restore_streams(self._replica, streams)
                # A stream that ended while the restore ran must not stay counted.
                ended = [s.stream_id for s in streams if s.stream_id not in self._open]
                if ended:
                    await self._delete(ended)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self._beat()
                if self._unclosed:
                    pending = list(self._unclosed)
                    self._unclosed.clear()
                    await self._delete(pending)
                await self._store.sweep_replicas(self._clock.now())
            except StoreUnavailable:
                continue
            except Exception:
                log.exception("stream registry: heartbeat failed")
