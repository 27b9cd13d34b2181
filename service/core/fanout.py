"""In-process fan-out of session events to attached Chat streams (SPEC section 3).

One ``Hub`` per process. The turn runner publishes events here after their commit; the
cross-replica notifier calls ``on_remote_events`` when another replica committed some,
and the hub reads them from the store once for all of the session's streams here. An
idle stream is a queue in a dict: no database connection, timer or poll of its own.

Each stream has a bounded ``StreamQueue`` (default 1,000 events or 1 MiB). Text deltas
that back up are merged into the queued delta; session events that overflow end the
stream with ``RESOURCE_EXHAUSTED``/``SLOW_CONSUMER``, and the client reopens with
``after_sequence``. Publishing never waits for a consumer, so a slow stream never slows
the turn or other streams.

Events reach each queue in sequence order without gaps or duplicates: an event that
arrives early (two commits of one session published out of order) waits in the
queue's reorder buffer, and a gap that does not fill itself is read from the store.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field

from service.core.errors import NotFound, PlannerError, ResourceExhausted
from service.core.model import EventKind, SessionEvent, TextDelta, ToolCallProgress

log = logging.getLogger(__name__)

#: Reads up to ``limit`` events of a session after a sequence (``SessionStore.events_after``).
EventReader = Callable[[str, int, int], Awaitable[list[SessionEvent]]]

_EVENT_OVERHEAD_BYTES = 256
# Events read from the store at once when replaying.
_REPLAY_BATCH = 500


def event_size(item: SessionEvent | TextDelta | object) -> int:
    """Approximate bytes an item holds in a queue (for the 1 MiB bound)."""
    if isinstance(item, SessionEvent):
        return _EVENT_OVERHEAD_BYTES + (item.message.size_bytes() if item.message else 0)
    if isinstance(item, TextDelta):
        return _EVENT_OVERHEAD_BYTES + len(item.text.encode())
    return _EVENT_OVERHEAD_BYTES


@dataclass(frozen=True)
class StreamEnd:
    """The last item of a queue: the stream ends with ``error`` (None: ends cleanly)."""

    error: PlannerError | None


@dataclass(eq=False)
class StreamQueue:
    """The bounded outbound queue of one Chat stream attached to one session.

    Items are ``SessionEvent`` (in sequence order), ``TextDelta``, ``StreamEnd`` and
    replies (any other object, passed through). ``last_sequence`` is the newest session
    event accepted into the queue; ``delivered_sequence`` the newest one taken out by
    ``get`` (the stream has it, or is sending it), which an overflow reports.
    """

    session_id: str
    human_id: str
    last_sequence: int
    max_events: int = 1000
    max_bytes: int = 1 << 20
    _items: deque[object] = field(default_factory=deque)
    _bytes: int = 0
    _pending: dict[int, SessionEvent] = field(default_factory=dict)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _taken: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    delivered_sequence: int = -1

    def __post_init__(self) -> None:
        if self.delivered_sequence < 0:
            self.delivered_sequence = self.last_sequence

    def put_reply(self, reply: object) -> None:
        """Queue a reply for this stream only (not counted against the bounds)."""
        if not self.closed:
            self._items.append(reply)
            self._ready.set()

    def offer(self, event: SessionEvent) -> bool:
        """Accept a session event; returns True when a gap is left to fill from the store."""
        if self.closed or event.sequence <= self.last_sequence:
            return False
        self._pending[event.sequence] = event
        while self.last_sequence + 1 in self._pending:
            ready = self._pending.pop(self.last_sequence + 1)
            self.last_sequence = ready.sequence
            self._push(ready)
            if self.closed:
                return False
        return bool(self._pending)

    def offer_transient(self, item: object) -> None:
        """Accept an item that is neither stored nor replayed (tool-call progress); it is
        dropped when the queue is at its bounds, never ending the stream."""
        if self.closed or len(self._items) >= self.max_events:
            return
        self._items.append(item)
        self._bytes += event_size(item)
        self._ready.set()

    def offer_delta(self, delta: TextDelta) -> None:
        """Accept a text delta, merging it into a queued delta of the same answer."""
        if self.closed:
            return
        if self._items:
            tail = self._items[-1]
            if (
                isinstance(tail, TextDelta)
                and tail.message_id == delta.message_id
                and tail.offset + len(tail.text) == delta.offset
            ):
                merged = TextDelta(
                    tail.session_id,
                    tail.turn_id,
                    tail.message_id,
                    tail.offset,
                    tail.text + delta.text,
                )
                self._items[-1] = merged
                self._bytes += len(delta.text.encode())
                return
        if len(self._items) >= self.max_events or self._bytes >= self.max_bytes:
            # Deltas are not stored: a backed-up stream may lose some, and the
            # assistant_message event still carries the whole text.
            return
        self._items.append(delta)
        self._bytes += event_size(delta)
        self._ready.set()

    def end(self, error: PlannerError | None) -> None:
        """End the stream after what is queued (or at once for an overflow)."""
        if self.closed:
            return
        self.closed = True
        self._items.append(StreamEnd(error))
        self._ready.set()
        self._taken.set()  # a replay waiting for room stops

    def _push(self, event: SessionEvent) -> None:
        size = event_size(event)
        # An event larger than the byte bound still goes to a stream that has nothing
        # queued: refusing it would end every stream of the session, replays included.
        over_bytes = self._bytes > 0 and self._bytes + size > self.max_bytes
        if len(self._items) >= self.max_events or over_bytes:
            self._items.clear()
            self._bytes = 0
            self.end(
                ResourceExhausted(
                    "the stream fell behind; reopen with after_sequence",
                    reason="SLOW_CONSUMER",
                    # What the client got: the queued events were dropped with the rest.
                    metadata={"last_sequence": str(self.delivered_sequence)},
                )
            )
            return
        self._items.append(event)
        self._bytes += size
        self._ready.set()

    async def get(self) -> object:
        """Wait for and return the next item."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        self._bytes = max(0, self._bytes - event_size(item))
        if isinstance(item, SessionEvent):
            self.delivered_sequence = item.sequence
        self._taken.set()
        return item

    def has_room(self, event: SessionEvent) -> bool:
        """Whether ``event`` fits the bounds now (the overflow test of ``_push``)."""
        size = event_size(event)
        over_bytes = self._bytes > 0 and self._bytes + size > self.max_bytes
        return len(self._items) < self.max_events and not over_bytes

    async def wait_for_room(self, event: SessionEvent) -> None:
        """Wait until ``event`` fits, or the queue is closed: a replay waits for its own
        stream to take what it queued, rather than overflowing the queue itself."""
        while not self.closed and not self.has_room(event):
            self._taken.clear()
            await self._taken.wait()

    @property
    def has_gap(self) -> bool:
        """True when events wait in the reorder buffer for a missing sequence."""
        return bool(self._pending)


class Hub:
    """Routes a process's session events and text deltas to the attached streams."""

    def __init__(
        self, read_events: EventReader, *, max_events: int = 1000, max_bytes: int = 1 << 20
    ) -> None:
        self._read = read_events
        self._max_events = max_events
        self._max_bytes = max_bytes
        self._queues: dict[str, set[StreamQueue]] = {}
        self._streams: set[StreamQueue] = set()
        # The answer streaming in each session: its first delta and the pieces so far
        # (joined only when a stream attaches mid-answer, not on every delta).
        self._answers: dict[str, tuple[TextDelta, list[str]]] = {}
        self._filling: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

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
        )
        self._queues.setdefault(session_id, set()).add(queue)
        self._streams.add(queue)
        return queue

    def bind(self, queue: StreamQueue, session_id: str, after_sequence: int) -> None:
        """Attach an existing queue (one that already carried replies) to a session."""
        queue.session_id = session_id
        queue.last_sequence = queue.delivered_sequence = after_sequence
        self._queues.setdefault(session_id, set()).add(queue)

    def new_queue(self, human_id: str) -> StreamQueue:
        """A queue for a stream not yet attached to any session (replies only)."""
        queue = StreamQueue("", human_id, 0, max_events=self._max_events, max_bytes=self._max_bytes)
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
        queue.closed = True

    async def replay(self, queue: StreamQueue, until_sequence: int) -> None:
        """Queue the stored events after the queue's position: up to ``until_sequence``
        (the last sequence when the caller read the session) and on to the newest, since
        events committed between that read and ``bind`` were published before the queue
        was attached and would be missed (SPEC 3: ``after_sequence`` replays them).

        Each event waits for room in the queue (the stream taking what is queued), so a
        replay within ``max_replay_events`` never overflows a stream that reads. Then, if
        an answer is streaming, one text delta with the text so far (SPEC 3).
        """
        while not queue.closed:
            wanted = until_sequence - queue.last_sequence
            # One row more than expected tells whether events came after the caller's read.
            limit = min(_REPLAY_BATCH, wanted + 1) if wanted > 0 else _REPLAY_BATCH
            batch = await self._read(queue.session_id, queue.last_sequence, limit)
            for event in batch:
                # A replay is as large as the client asked (up to max_replay_events), not
                # a sign of a slow stream: it waits for room instead of overflowing.
                await queue.wait_for_room(event)
                queue.offer(event)
            if len(batch) < limit:
                break
        answer = self._answers.get(queue.session_id)
        if answer is not None:
            first, parts = answer
            queue.offer_delta(
                TextDelta(first.session_id, first.turn_id, first.message_id, 0, "".join(parts))
            )

    def stream_count(self, human_id: str | None = None) -> int:
        """Open streams in this process, of one human when given."""
        return sum(1 for q in self._streams if human_id is None or q.human_id == human_id)

    # --------------------------------------------------------------- publishing

    def publish(self, events: list[SessionEvent]) -> None:
        """Deliver events committed by this process (call after the commit)."""
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
            for queue in tuple(self._queues.get(event.session_id, ())):
                if queue.offer(event):
                    self._schedule_fill(event.session_id)

    def publish_delta(self, delta: TextDelta) -> None:
        """Deliver a text delta to this process's streams of the session."""
        current = self._answers.get(delta.session_id)
        if current is not None and current[0].message_id == delta.message_id:
            current[1].append(delta.text)
        else:
            self._answers[delta.session_id] = (delta, [delta.text])
        for queue in tuple(self._queues.get(delta.session_id, ())):
            queue.offer_delta(delta)

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
        for queue in tuple(self._queues.pop(session_id, ())):
            queue.end(NotFound("the session was deleted", reason="SESSION_NOT_FOUND"))
        self._answers.pop(session_id, None)

    def close_all(self, error: PlannerError | None) -> None:
        """End every stream, attached to a session or not (shutdown)."""
        self._queues.clear()
        for queue in tuple(self._streams):
            queue.end(error)

    def close_idle(self, error: PlannerError | None, busy: Collection[str]) -> None:
        """End every stream but those attached to a session in ``busy`` (shutdown: the
        streams of a session whose turn still runs here wait for its end)."""
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
        queues = tuple(self._queues.get(session_id, ()))
        if not queues:
            return
        start = min(q.last_sequence for q in queues)
        while True:
            batch = await self._read(session_id, start, 500)
            if not batch:
                return
            for event in batch:
                self.publish([event])
            start = batch[-1].sequence
            if len(batch) < 500:
                return
