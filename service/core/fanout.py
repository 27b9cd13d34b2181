"""In-process fan-out of session events to attached Chat streams (docs/spec/api-and-streams.md).

One ``Hub`` per process. The turn runner publishes events here after their commit; the
cross-replica notifier calls ``on_remote_events`` when another replica committed some,
and the hub reads them from the store once for all of the session's streams here. An
idle stream is a queue in a dict: no database connection, timer or poll of its own.

Each stream has a bounded ``StreamQueue``: at most 1,000 items and 1 MiB queued beyond
the batch it is delivering (decisions 0220, 0225). A batch is what one
publish brings: the events of one commit (a round's answer, calls and results may be
several MiB), or what one read of the store returned. A client is behind by the batches
it has not begun to take, not by the size of the one it is taking, so a large event
never ends a stream that keeps up. Text deltas that back up are merged into the queued
delta; session events that overflow end the stream with
``RESOURCE_EXHAUSTED``/``SLOW_CONSUMER``, and the client reopens with
``after_sequence``. Publishing never waits for a consumer, so a slow stream never slows
the turn or other streams. Every event, delta and catch-up text is cut to what a client
is sent (``service.core.client_copy``, decision 0222) once, before it is queued.

Events reach each queue in sequence order without gaps or duplicates: an event that
arrives early (two commits of one session published out of order) waits in the
queue's reorder buffer, and a gap that does not fill itself is read from the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.core.client_copy import CLIENT_MESSAGE_MAX_BYTES, delta_for_client, event_for_client
from service.core.errors import NotFound, PlannerError, ResourceExhausted, Unavailable
from service.core.model import EventKind, SessionEvent, TextDelta, ToolCallProgress

if TYPE_CHECKING:
    from service.core.chat import Outbound, Reply

log = logging.getLogger(__name__)

#: Reads up to ``limit`` events of a session after a sequence (``SessionStore.events_after``).
EventReader = Callable[[str, int, int], Awaitable[list[SessionEvent]]]

_EVENT_OVERHEAD_BYTES = 256
# Events read from the store at once when replaying, and when filling a gap.
_REPLAY_BATCH = 500
#: The longest a catch-up waits for a session's streams to take one read of the store
#: before it publishes the next (seconds; decision 0226).
CATCH_UP_WAIT_S = 5.0


def event_size(item: SessionEvent | TextDelta | object) -> int:
    """Approximate bytes an item holds in a queue (for the 1 MiB bound); a message's size
    is computed once per message, however many queues hold it."""
    if isinstance(item, SessionEvent):
        return _EVENT_OVERHEAD_BYTES + (item.message.size_bytes() if item.message else 0)
    if isinstance(item, TextDelta):
        return _EVENT_OVERHEAD_BYTES + len(item.text.encode())
    return _EVENT_OVERHEAD_BYTES


@dataclass(frozen=True)
class StreamEnd:
    """The last item of a queue: the stream ends with ``error`` (None: ends cleanly)."""

    error: PlannerError | None


@dataclass(frozen=True)
class Heartbeat:
    """Sent on a stream that had nothing to send for ``heartbeat_s``: data on an idle
    stream, so proxies with an idle timeout keep it open (clients ignore it)."""


HEARTBEAT = Heartbeat()


@dataclass(eq=False, slots=True)
class _Batch:
    """Items queued by one publish (or one reply, delta or progress), and their bytes."""

    items: int = 0
    bytes: int = 0


@dataclass(eq=False)
class StreamQueue:
    """The bounded outbound queue of one Chat stream attached to one session.

    Items are the ``Outbound`` values: ``SessionEvent`` (in sequence order),
    ``TextDelta``, ``ToolCallProgress``, the replies, ``Heartbeat`` and, last,
    ``StreamEnd``. ``last_sequence`` is the newest session event accepted into the
    queue; ``delivered_sequence`` the newest one taken out by ``get`` (the stream has
    it, or is sending it), which an overflow reports.

    Bounds (decisions 0220, 0225): at most ``max_events`` items and ``max_bytes`` bytes
    queued beyond the oldest batch, the one the stream is delivering.
    Items join the queue in batches: ``offer_batch`` queues one commit's events as one,
    each reply, delta and progress item is one of its own. A batch that arrives at an
    empty queue is taken whatever its size; one that arrives behind others counts, and
    a session event that does not fit ends the stream ``SLOW_CONSUMER``.

    A stream that waits ``heartbeat_s`` seconds (0: never) on an empty queue gets a
    ``Heartbeat``: one timer while it waits, none while items flow.
    """

    session_id: str
    human_id: str
    last_sequence: int
    max_events: int = 1000
    max_bytes: int = 1 << 20
    heartbeat_s: float = 0.0
    _items: deque[tuple[Outbound, int, _Batch]] = field(default_factory=deque)
    _batches: deque[_Batch] = field(default_factory=deque)
    _bytes: int = 0
    _pending: dict[int, SessionEvent] = field(default_factory=dict)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _taken: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    delivered_sequence: int = -1

    def __post_init__(self) -> None:
        if self.delivered_sequence < 0:
            self.delivered_sequence = self.last_sequence

    @property
    def behind_bytes(self) -> int:
        """Bytes queued beyond the batch the stream is delivering (the oldest queued)."""
        return self._bytes - self._batches[0].bytes if self._batches else 0

    @property
    def behind_items(self) -> int:
        """Items queued beyond the batch the stream is delivering (the oldest queued)."""
        return len(self._items) - self._batches[0].items if self._batches else 0

    def put_reply(self, reply: Reply) -> None:
        """Queue a reply for this stream only (not counted against the bounds)."""
        if not self.closed:
            self._append(reply, 0, self._new_batch())

    def offer(self, event: SessionEvent) -> bool:
        """Accept one session event as a batch of its own; see ``offer_batch``."""
        return self.offer_batch((event,))

    def offer_batch(self, events: Sequence[SessionEvent]) -> bool:
        """Accept session events published together (one commit, or one read of the
        store) as one batch; returns True when a gap is left to fill from the store."""
        if self.closed:
            return False
        for event in events:
            if event.sequence > self.last_sequence:
                self._pending[event.sequence] = event
        batch: _Batch | None = None
        while self.last_sequence + 1 in self._pending:
            ready = self._pending.pop(self.last_sequence + 1)
            self.last_sequence = ready.sequence
            batch = self._push(ready, batch)
            if self.closed:
                return False
        return bool(self._pending)

    def offer_transient(self, item: ToolCallProgress) -> None:
        """Accept an item that is neither stored nor replayed (tool-call progress); it is
        dropped when the queue is at its bounds, never ending the stream."""
        if self.closed:
            return
        size = event_size(item)
        if self._fits(size):
            self._append(item, size, self._new_batch())

    def offer_delta(self, delta: TextDelta) -> None:
        """Accept a text delta, merging it into a queued delta of the same answer while
        the merged one stays within ``max_bytes``."""
        if self.closed:
            return
        added = len(delta.text.encode())
        if self._items:
            tail, size, batch = self._items[-1]
            if (
                isinstance(tail, TextDelta)
                and tail.message_id == delta.message_id
                and tail.offset + len(tail.text) == delta.offset
            ):
                if size + added > self.max_bytes:
                    # Deltas are not stored: a backed-up stream may lose some, and the
                    # assistant_message event still carries the whole text.
                    return
                merged = TextDelta(
                    tail.session_id,
                    tail.turn_id,
                    tail.message_id,
                    tail.offset,
                    tail.text + delta.text,
                )
                self._items[-1] = (merged, size + added, batch)
                batch.bytes += added
                self._bytes += added
                return
        size = _EVENT_OVERHEAD_BYTES + added
        if self._fits(size):
            self._append(delta, size, self._new_batch())

    def _beat(self) -> None:
        if not self.closed and not self._items:
            self._append(HEARTBEAT, 0, self._new_batch())

    def end(self, error: PlannerError | None) -> None:
        """End the stream after what is queued (or at once for an overflow)."""
        if self.closed:
            return
        self.closed = True
        self._append(StreamEnd(error), 0, self._new_batch())
        self._taken.set()  # a replay waiting for room stops

    def _fits(self, size: int) -> bool:
        """Whether an item of ``size`` bytes fits as a batch of its own."""
        if not self._items:
            return True
        return self.behind_items < self.max_events and self.behind_bytes + size <= self.max_bytes

    def _new_batch(self) -> _Batch:
        batch = _Batch()
        self._batches.append(batch)
        return batch

    def _append(self, item: Outbound, size: int, batch: _Batch) -> None:
        self._items.append((item, size, batch))
        batch.items += 1
        batch.bytes += size
        self._bytes += size
        self._ready.set()

    def _push(self, event: SessionEvent, batch: _Batch | None) -> _Batch | None:
        size = event_size(event)
        if batch is None:
            batch = self._new_batch()
        # The batch being delivered is taken whatever its length and size: one read of
        # the store that catches a follower up is not a sign of a slow client (0225).
        if self._batches[0] is not batch and (
            self.behind_items >= self.max_events or self.behind_bytes + size > self.max_bytes
        ):
            self._items.clear()
            self._batches.clear()
            self._bytes = 0
            self.end(
                ResourceExhausted(
                    "the stream fell behind; reopen with after_sequence",
                    reason="SLOW_CONSUMER",
                    # What the client got: the queued events were dropped with the rest.
                    metadata={"last_sequence": str(self.delivered_sequence)},
                )
            )
            return None
        self._append(event, size, batch)
        return batch

    async def get(self) -> Outbound:
        """Wait for and return the next item (a ``Heartbeat`` after ``heartbeat_s`` of
        waiting)."""
        if not self._items:
            timer = (
                asyncio.get_running_loop().call_later(self.heartbeat_s, self._beat)
                if self.heartbeat_s > 0
                else None
            )
            try:
                while not self._items:
                    self._ready.clear()
                    await self._ready.wait()
            finally:
                if timer is not None:
                    timer.cancel()
        item, size, batch = self._items.popleft()
        batch.items -= 1
        batch.bytes -= size
        self._bytes -= size
        if batch.items == 0:
            # Items leave in the order they came, so the emptied batch is the oldest.
            self._batches.popleft()
        if isinstance(item, SessionEvent):
            self.delivered_sequence = item.sequence
        self._taken.set()
        return item

    def has_room(self, event: SessionEvent) -> bool:
        """Whether ``event`` fits the bounds now as a batch of its own (the overflow
        test of ``offer``)."""
        return self._fits(event_size(event))

    async def wait_for_room(self, event: SessionEvent) -> None:
        """Wait until ``event`` fits, or the queue is closed: a replay waits for its own
        stream to take what it queued, rather than overflowing the queue itself."""
        while not self.closed and not self.has_room(event):
            self._taken.clear()
            await self._taken.wait()

    async def wait_delivered(self, sequence: int) -> None:
        """Wait until the stream has taken the session events up to ``sequence``, or
        the queue is closed."""
        while not self.closed and self.delivered_sequence < sequence:
            self._taken.clear()
            await self._taken.wait()

    @property
    def has_gap(self) -> bool:
        """True when events wait in the reorder buffer for a missing sequence."""
        return bool(self._pending)


class Hub:
    """Routes a process's session events and text deltas to the attached streams."""

    def __init__(
        self,
        read_events: EventReader,
        *,
        max_events: int = 1000,
        max_bytes: int = 1 << 20,
        client_message_max_bytes: int = CLIENT_MESSAGE_MAX_BYTES,
        heartbeat_s: float = 0.0,
        catch_up_wait_s: float = CATCH_UP_WAIT_S,
    ) -> None:
        """``heartbeat_s``: idle seconds after which a stream gets a ``Heartbeat`` (0:
        never); ``catch_up_wait_s``: how long a catch-up longer than one read waits for
        the streams to take a read before the next (decision 0226)."""
        self._read = read_events
        self._heartbeat_s = heartbeat_s
        self._max_events = max_events
        self._max_bytes = max_bytes
        self._client_max = client_message_max_bytes
        self._queues: dict[str, set[StreamQueue]] = {}
        self._streams: set[StreamQueue] = set()
        # The answer streaming in each session: its first delta and the pieces so far
        # (joined only when a stream attaches mid-answer, not on every delta).
        self._answers: dict[str, tuple[TextDelta, list[str]]] = {}
        self._filling: set[str] = set()
        self._catch_up_wait_s = catch_up_wait_s
        # Sessions whose catch-up runs, and whether it must read once more at its end.
        self._catching_up: dict[str, bool] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._follow: Callable[[str], None] | None = None
        self._unfollow: Callable[[str], None] | None = None
        # Set by ``close_idle`` (shutdown): a stream ends with it once its session's turn
        # has ended and everything before the end is queued.
        self._closing: PlannerError | None = None
        self._shutting_down = False

    def on_follow(self, follow: Callable[[str], None], unfollow: Callable[[str], None]) -> None:
        """Call ``follow(session_id)`` when a session gets its first stream in this
        process, and ``unfollow(session_id)`` when its last stream leaves (e.g. to listen
        to the session's notifications only while a stream here follows it)."""
        self._follow, self._unfollow = follow, unfollow

    def _add(self, session_id: str, queue: StreamQueue) -> None:
        queues = self._queues.get(session_id)
        if queues is None:
            queues = self._queues[session_id] = set()
            if self._follow is not None:
                self._follow(session_id)
        queues.add(queue)

    def _forget(self, session_id: str) -> None:
        if self._unfollow is not None:
            self._unfollow(session_id)

    # ----------------------------------------------------------------- streams

    def attach(self, session_id: str, human_id: str, after_sequence: int) -> StreamQueue:
        """Attach a stream to a session; it gets events after ``after_sequence``.

        The caller replays stored events with ``replay`` before reading live ones.
        """
        queue = StreamQueue(
            session_id,
            human_id,
            after_sequence,
            max_events=self._max_events,
            max_bytes=self._max_bytes,
            heartbeat_s=self._heartbeat_s,
        )
        self._add(session_id, queue)
        self._streams.add(queue)
        return queue

    def bind(self, queue: StreamQueue, session_id: str, after_sequence: int) -> None:
        """Attach an existing queue (one that already carried replies) to a session."""
        queue.session_id = session_id
        queue.last_sequence = queue.delivered_sequence = after_sequence
        self._add(session_id, queue)

    def new_queue(self, human_id: str) -> StreamQueue:
        """A queue for a stream not yet attached to any session (replies only)."""
        queue = StreamQueue(
            "",
            human_id,
            0,
            max_events=self._max_events,
            max_bytes=self._max_bytes,
            heartbeat_s=self._heartbeat_s,
        )
        self._streams.add(queue)
        return queue

    def detach(self, queue: StreamQueue) -> None:
        """Detach a stream; idempotent."""
        self._streams.discard(queue)
        queues = self._queues.get(queue.session_id)
        if queues is not None:
            queues.discard(queue)
            if not queues:
                del self._queues[queue.session_id]
                self._forget(queue.session_id)
        queue.closed = True

    async def replay(self, queue: StreamQueue, until_sequence: int) -> None:
        """Queue the stored events after the queue's position: up to ``until_sequence``
        (the last sequence when the caller read the session) and on to the newest, since
        events committed between that read and ``bind`` were published before the queue
        was attached and would be missed (docs/spec/api-and-streams.md: ``after_sequence`` replays
        them).

        Each event waits for room in the queue (the stream taking what is queued), so a
        replay within ``max_replay_events`` never overflows a stream that reads. Then, if
        an answer is streaming, one text delta with the text so far (docs/spec/api-and-streams.md).
        """
        while not queue.closed:
            wanted = until_sequence - queue.last_sequence
            # One row more than expected tells whether events came after the caller's read.
            limit = min(_REPLAY_BATCH, wanted + 1) if wanted > 0 else _REPLAY_BATCH
            batch = await self._read(queue.session_id, queue.last_sequence, limit)
            for event in batch:
                # A replay is as large as the client asked (up to max_replay_events), not
                # a sign of a slow stream: it waits for room instead of overflowing.
                sent = event_for_client(event, self._client_max)
                await queue.wait_for_room(sent)
                queue.offer(sent)
            if len(batch) < limit:
                break
        answer = self._answers.get(queue.session_id)
        if answer is not None:
            first, parts = answer
            so_far = TextDelta(first.session_id, first.turn_id, first.message_id, 0, "".join(parts))
            queue.offer_delta(delta_for_client(so_far, self._client_max))

    def stream_count(self, human_id: str | None = None) -> int:
        """Streams attached to a session in this process, of one human when given."""
        return sum(
            1
            for q in self._streams
            if q.session_id and (human_id is None or q.human_id == human_id)
        )

    # --------------------------------------------------------------- publishing

    def publish(self, events: list[SessionEvent]) -> None:
        """Deliver events committed by this process (call after the commit), or read
        from the store at once: one batch for each stream of their session."""
        sessions: dict[str, list[SessionEvent]] = {}
        queues = self._queues
        for event in events:
            if event.kind in (EventKind.ASSISTANT_MESSAGE, EventKind.TURN_ENDED):
                answer = self._answers.get(event.session_id)
                if answer is not None and (
                    event.kind is EventKind.TURN_ENDED
                    or (
                        event.message is not None
                        and event.message.message_id == answer[0].message_id
                    )
                ):
                    del self._answers[event.session_id]
            if event.session_id in queues:
                sessions.setdefault(event.session_id, []).append(
                    event_for_client(event, self._client_max)
                )
        for session_id, batch in sessions.items():
            ended = self._shutting_down and any(e.kind is EventKind.TURN_ENDED for e in batch)
            for queue in tuple(queues.get(session_id, ())):
                if queue.offer_batch(batch):
                    self._schedule_fill(session_id)
                if ended and not queue.has_gap:
                    # Shutting down: the session's turn has ended and its stream has
                    # everything up to the end; it closes now, not with the last turn.
                    queue.end(self._closing)

    def publish_delta(self, delta: TextDelta) -> None:
        """Deliver a text delta to this process's streams of the session."""
        current = self._answers.get(delta.session_id)
        if current is not None and current[0].message_id == delta.message_id:
            current[1].append(delta.text)
        else:
            self._answers[delta.session_id] = (delta, [delta.text])
        queues = self._queues.get(delta.session_id)
        if queues:
            sent = delta_for_client(delta, self._client_max)
            for queue in tuple(queues):
                queue.offer_delta(sent)

    def publish_progress(self, progress: ToolCallProgress) -> None:
        """Deliver a tool call's progress to this process's streams of the session; a
        stream whose queue is full misses it (it is transient, like a delta)."""
        for queue in tuple(self._queues.get(progress.session_id, ())):
            queue.offer_transient(progress)

    def clear_answer(self, session_id: str) -> None:
        """Forget a streaming answer that ended without an assistant message."""
        self._answers.pop(session_id, None)

    async def on_remote_events(self, session_id: str, last_sequence: int) -> None:
        """Another replica committed events of ``session_id`` up to ``last_sequence``;
        ``-1`` means the session was deleted."""
        if last_sequence < 0:
            self.session_deleted(session_id)
            return
        queues = self._queues.get(session_id)
        if queues and any(q.last_sequence < last_sequence for q in queues):
            await self._fill(session_id)

    async def resync(self) -> None:
        """Re-read every attached session (after the notifier reconnected)."""
        for session_id in tuple(self._queues):
            await self._fill(session_id)

    def session_deleted(self, session_id: str) -> None:
        """End every stream of a deleted session with NOT_FOUND."""
        queues = self._queues.pop(session_id, None)
        if queues is not None:
            self._forget(session_id)
            for queue in tuple(queues):
                queue.end(NotFound("the session was deleted", reason="SESSION_NOT_FOUND"))
        self._answers.pop(session_id, None)

    def close_all(self, error: PlannerError | None) -> None:
        """End every stream, attached to a session or not (shutdown)."""
        for session_id in tuple(self._queues):
            self._forget(session_id)
        self._queues.clear()
        for queue in tuple(self._streams):
            queue.end(error)

    def let_go(self, message: str) -> int:
        """End every stream ``UNAVAILABLE``/``REPLICA_UNAVAILABLE`` (decision 0314): this
        replica can no longer keep its leases, another can serve the clients. Each
        stream's ``ErrorInfo`` carries its ``session_id`` and the ``last_sequence`` it
        delivered, so a gateway reopens it elsewhere with ``after_sequence`` and misses
        nothing. Returns how many streams were ended. New streams are not refused here."""
        ended = 0
        for queue in tuple(self._streams):
            if queue.closed:
                continue
            metadata: dict[str, str] = {}
            if queue.session_id:
                # What is queued is still sent before the end: the client has it all.
                metadata["session_id"] = queue.session_id
                metadata["last_sequence"] = str(queue.last_sequence)
            queue.end(Unavailable(message, reason="REPLICA_UNAVAILABLE", metadata=metadata))
            ended += 1
        return ended

    def close_idle(self, error: PlannerError | None, busy: Collection[str]) -> None:
        """Shutdown: end every stream but those attached to a session in ``busy`` (whose
        turn still runs here) now, and each of those as soon as its session's turn ends
        (its ``turn_ended`` queued, nothing missing before it). ``close_all`` ends what
        is left."""
        self._closing, self._shutting_down = error, True
        for queue in tuple(self._streams):
            if queue.session_id not in busy:
                queue.end(error)

    # ------------------------------------------------------------------ gaps

    def _schedule_fill(self, session_id: str) -> None:
        if session_id in self._filling:
            return
        self._filling.add(session_id)
        task = asyncio.get_running_loop().create_task(self._fill_later(session_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fill_later(self, session_id: str) -> None:
        try:
            # Out-of-order local commits fill their own gap within a few loop turns;
            # read the store only for a gap that stays.
            for _ in range(3):
                await asyncio.sleep(0)
            if any(q.has_gap for q in self._queues.get(session_id, ())):
                await self._fill(session_id)
        except Exception:
            log.exception("filling a gap in session events failed")
        finally:
            self._filling.discard(session_id)

    async def _fill(self, session_id: str) -> None:
        """Read what the session's streams here miss and publish it: one read of at most
        ``_REPLAY_BATCH`` events, published as one batch (decision 0225). A longer
        catch-up goes on in a task of its own, each further read after the streams took
        the last one (decision 0226); meanwhile a fill asks it for one more read."""
        if session_id in self._catching_up:
            self._catching_up[session_id] = True
            return
        queues = tuple(self._queues.get(session_id, ()))
        if not queues:
            return
        batch = await self._read(session_id, min(q.last_sequence for q in queues), _REPLAY_BATCH)
        if not batch:
            return
        # One batch, as the commits it holds were: a stream is not behind by them.
        self.publish(batch)
        if len(batch) == _REPLAY_BATCH and session_id not in self._catching_up:
            self._catching_up[session_id] = False
            task = asyncio.get_running_loop().create_task(
                self._catch_up(session_id, batch[-1].sequence)
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _catch_up(self, session_id: str, published: int) -> None:
        """Publish the rest of a long catch-up, one read at a time, each once every
        stream of the session took the one before (up to ``sequence`` ``published``) or
        ``catch_up_wait_s`` passed: a stream that reads is not ended ``SLOW_CONSUMER``
        for its replica's long read, one that does not still overflows its bounds."""
        try:
            while True:
                queues = tuple(self._queues.get(session_id, ()))
                if not queues:
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._catch_up_wait_s):
                        for queue in queues:
                            await queue.wait_delivered(published)
                self._catching_up[session_id] = False
                queues = tuple(self._queues.get(session_id, ()))
                if not queues:
                    return
                start = min(q.last_sequence for q in queues)
                batch = await self._read(session_id, start, _REPLAY_BATCH)
                if batch:
                    self.publish(batch)
                    published = batch[-1].sequence
                if len(batch) < _REPLAY_BATCH and not self._catching_up[session_id]:
                    return
        except Exception:
            log.exception("catching up with session events failed")
        finally:
            self._catching_up.pop(session_id, None)
