"""Open Chat streams per human, counted across replicas (docs/spec/limits.md: at most 16).

``StreamRegistry`` is the replica's side of the count (docs/decisions/0080-cross-replica-
stream-count.md). Each open stream is one row in the ``StreamStore`` (stream id, human,
replica, opened at), inserted when the stream opens and deleted when it ends; the count
and the insert run in one transaction serialized per human, so two replicas opening a
human's seventeenth stream at once cannot both succeed. An idle stream holds a row, not
a database connection, timer or poll.

Taking and giving back a slot is cancellation-safe by construction (decision
0182): ``open`` returns a ``StreamSlot`` at once and admits it in a task this registry
owns; ``StreamSlot.release`` is synchronous and idempotent, so the Chat RPC ties it to
the call's end (its done callback), and a slot released while its admission is in
flight is deleted by that admission. No caller's cancellation reaches either.

A replica's rows count only while its lease holds. One loop per process, every
``min(lease_s / 3, sweep_interval_s)`` seconds (the heartbeat interval):

- renews this replica's lease (a heartbeat); when it finds the replica's row gone (a
  lapse long enough for another replica to sweep it, e.g. a database outage), it
  re-records every stream still open here, so the count is right again;
- retries the deletes of streams that ended while the database was unreachable;
- removes this replica's rows whose stream is not open here (nothing should leave one;
  if anything did, it counts against its human for at most one heartbeat interval);
- forgets replicas whose lease expired (a replica killed with SIGKILL) and their rows.

Start-up forgets rows a replica of the same id left in an earlier life; shutdown
forgets this replica's rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Coroutine
from datetime import timedelta
from typing import Any, TypeVar

from service.core.errors import ResourceExhausted, StoreConflict, StoreUnavailable, Unavailable
from service.core.ports import Clock, OpenStream, StreamStore

log = logging.getLogger(__name__)

T = TypeVar("T")

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
        #: Streams whose admission is in flight, and streams admitted and not released.
        self._admitting: dict[str, OpenStream] = {}
        self._open: dict[str, OpenStream] = {}
        #: Streams whose delete is in flight or to be retried (``_unclosed``).
        self._closing: set[str] = set()
        self._unclosed: set[str] = set()
        #: While the heartbeat reads this replica's rows: the streams deleted meanwhile.
        self._deleted: set[str] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._stopped = False

    @property
    def heartbeat_s(self) -> float:
        """Seconds between two heartbeats: the bound on an orphan row (decision 0182)."""
        return self._interval_s

    @property
    def per_human(self) -> int:
        """Streams one human may have open across replicas."""
        return self._per_human

    @property
    def open_here(self) -> int:
        """Streams open on this replica."""
        return len(self._open)

    @property
    def admitting_here(self) -> int:
        """Streams of this replica whose admission is in flight (and not released)."""
        return len(self._admitting)

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
        down, the lease lapses and another replica sweeps them). Streams released after
        this are already forgotten; admissions after it are refused."""
        self._stopped = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.wait({self._loop_task})
        await self.settle()
        with contextlib.suppress(StoreUnavailable):
            await self._store.remove_replica(self._replica)
        self._open.clear()
        self._closing.clear()
        self._unclosed.clear()

    async def settle(self) -> None:
        """Wait for the admissions and deletes in flight, and those they start."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    def open(self, human_id: str) -> StreamSlot:
        """Start admitting one stream of ``human_id`` and return its slot at once.

        The admission (the count and the insert, one unit of work) runs in a task this
        registry owns: the caller awaits ``StreamSlot.admitted`` and may be cancelled
        meanwhile without leaving a row behind, as long as the slot is released however
        the stream ends (``StreamSlot.release``; the Chat RPC ties it to the call's end).
        """
        stream = OpenStream(
            stream_id=uuid.uuid4().hex,
            human_id=human_id,
            replica_id=self._replica,
            opened_at=self._clock.now(),
        )
        self._admitting[stream.stream_id] = stream
        task = self._own(self._admit(stream))
        return StreamSlot(self, stream.stream_id, task)

    async def _admit(self, stream: OpenStream) -> bool:
        stream_id = stream.stream_id
        try:
            admitted = await self._insert(stream)
        except BaseException:
            self._admitting.pop(stream_id, None)
            self._closing.discard(stream_id)
            raise
        if self._admitting.pop(stream_id, None) is None:
            # Released while its row was being inserted: the RPC is over.
            if admitted:
                await self._delete([stream_id])
            else:
                self._closing.discard(stream_id)
            return admitted
        if admitted:
            self._open[stream_id] = stream
        return admitted

    async def _insert(self, stream: OpenStream) -> bool:
        if self._stopped:
            raise Unavailable("the planner is shutting down", reason="SHUTTING_DOWN")
        try:
            return await self._store.open_stream(
                stream, limit=self._per_human, now=stream.opened_at
            )
        except StoreConflict:
            # This replica's row was swept after a lapse: register again, then retry.
            await self._beat()
            return await self._store.open_stream(
                stream, limit=self._per_human, now=stream.opened_at
            )

    def release(self, stream_id: str) -> None:
        """Forget a stream that ended, admitted or not; idempotent. Never waits and never
        fails: the delete runs in a task this registry owns (so a cancelled RPC cannot
        interrupt it), one still being admitted is deleted by its admission, and a
        delete the database refused is retried by the heartbeat loop."""
        if self._stopped:
            return
        if self._admitting.pop(stream_id, None) is not None:
            # Its admission deletes what it inserted.
            self._closing.add(stream_id)
        elif self._open.pop(stream_id, None) is not None:
            self._closing.add(stream_id)
            self._own(self._delete([stream_id]))

    def _own(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(_finished)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _delete(self, stream_ids: list[str]) -> None:
        self._closing.update(stream_ids)
        try:
            await self._store.close_streams(stream_ids)
        except Exception as error:
            self._unclosed.update(stream_ids)
            if not isinstance(error, StoreUnavailable):
                log.exception("stream registry: closing streams failed")
            return
        self._closing.difference_update(stream_ids)
        if self._deleted is not None:
            self._deleted.update(stream_ids)

    def _tracked(self) -> set[str]:
        return set(self._admitting) | set(self._open) | self._closing

    async def _reap(self) -> None:
        """Delete this replica's rows whose stream is not open here: nothing should
        leave one (every stream is released when its RPC ends), so this is the bound on
        any that something did leave (decision 0182)."""
        # While a row of this registry's exists, its stream is admitting, open or being
        # deleted here, from its admission to the delete's commit. So a row the read sees
        # is an orphan only if its stream is in none of these now and was not deleted
        # while the read ran.
        self._deleted = set()
        try:
            recorded = await self._store.replica_streams(self._replica)
            known = self._tracked() | self._deleted
        finally:
            self._deleted = None
        orphans = [stream_id for stream_id in recorded if stream_id not in known]
        if orphans:
            log.warning(
                "stream registry: %d stream rows without an open stream here; removed",
                len(orphans),
            )
            await self._delete(orphans)

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
                await self._reap()
                await self._store.sweep_replicas(self._clock.now())
            except StoreUnavailable:
                continue
            except Exception:
                log.exception("stream registry: heartbeat failed")


class StreamSlot:
    """One Chat stream's place in the count (``StreamRegistry.open``)."""

    def __init__(
        self, registry: StreamRegistry, stream_id: str, admission: asyncio.Task[bool]
    ) -> None:
        self._registry = registry
        self.stream_id = stream_id
        self._admission = admission

    async def admitted(self) -> None:
        """Wait for the admission. Raises ``ResourceExhausted``/``TOO_MANY_STREAMS``
        (with ``retry_after_s``) when the human already has ``per_human`` streams open on
        live replicas (docs/spec/limits.md), ``Unavailable`` (``DATABASE_UNAVAILABLE`` when the
        count cannot be read, ``SHUTTING_DOWN``). A caller cancelled here leaves the admission
        to finish; ``release`` then deletes what it stored."""
        if not await asyncio.shield(self._admission):
            registry = self._registry
            raise ResourceExhausted(
                f"at most {registry.per_human} open Chat streams per human; close one first",
                reason="TOO_MANY_STREAMS",
                retry_after_s=TOO_MANY_STREAMS_RETRY_S,
            )

    def release(self) -> None:
        """The stream ended (however): forget it. Synchronous and idempotent, so it can
        run from the RPC's done callback."""
        self._registry.release(self.stream_id)


def _finished(task: asyncio.Task[Any]) -> None:
    # Read, so that a failure nobody waits for (a caller that left) is not reported as
    # never retrieved; the failures that matter were logged where they happened.
    if not task.cancelled():
        task.exception()
