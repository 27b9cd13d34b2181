"""A stream queue that overflows (docs/spec/api-and-streams.md: bounded outbound queues; decision
0011).

The stream ends ``RESOURCE_EXHAUSTED``/``SLOW_CONSUMER`` and the client reopens with
``after_sequence``; the ErrorInfo's ``last_sequence`` must be what the stream actually
got, since the events still queued are dropped with the overflow.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from service.core.errors import ResourceExhausted
from service.core.fanout import Hub, StreamEnd, StreamQueue
from service.core.model import EventKind, Message, MessageKind, SessionEvent, TurnStartedData

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def event(sequence: int) -> SessionEvent:
    return SessionEvent(
        "s1", "t1", EventKind.TURN_STARTED, NOW, data=TurnStartedData("m", 4)
    ).with_sequence(sequence)


async def no_events(session_id: str, after: int, limit: int) -> list[SessionEvent]:
    return []


async def drain(queue: StreamQueue) -> list[object]:
    items: list[object] = []
    while not items or not isinstance(items[-1], StreamEnd):
        items.append(await queue.get())
    return items


async def test_overflow_reports_the_last_sequence_the_stream_was_given() -> None:
    queue = StreamQueue("s1", "alice", last_sequence=10, max_events=3)
    for sequence in (11, 12):
        queue.offer(event(sequence))
    assert queue.delivered_sequence == 10
    assert await queue.get() == event(11)  # the stream took 11; it is delivering 12
    for sequence in (13, 14, 15, 16):  # three fit behind 12, the fourth does not
        queue.offer(event(sequence))
    items = await drain(queue)
    end = items[-1]
    assert isinstance(end, StreamEnd) and isinstance(end.error, ResourceExhausted)
    assert end.error.reason == "SLOW_CONSUMER"
    # 12 to 15 were queued but dropped: the client must reopen after 11.
    assert end.error.metadata == {"last_sequence": "11"}
    assert items == [end]


async def test_a_queue_bound_to_a_session_counts_from_its_after_sequence() -> None:
    hub = Hub(no_events, max_events=1)
    queue = hub.new_queue("alice")
    hub.bind(queue, "s1", 7)
    for sequence in (8, 9, 10):  # 8 is being delivered, 9 is one behind, 10 overflows
        hub.publish([event(sequence)])
    items = await drain(queue)
    end = items[-1]
    assert isinstance(end, StreamEnd) and end.error is not None
    assert end.error.metadata == {"last_sequence": "7"}


def big_event(sequence: int, size: int) -> SessionEvent:
    message = Message(
        session_id="s1",
        turn_id="t1",
        message_id=f"m{sequence}",
        kind=MessageKind.ASSISTANT,
        create_time=NOW,
        text="x" * size,
    )
    return SessionEvent(
        "s1", "t1", EventKind.ASSISTANT_MESSAGE, NOW, message=message
    ).with_sequence(sequence)


async def test_an_event_larger_than_the_byte_bound_reaches_a_stream_that_keeps_up() -> None:
    queue = StreamQueue("s1", "alice", last_sequence=0, max_bytes=1024)
    queue.offer(big_event(1, 4096))
    assert await queue.get() == big_event(1, 4096)
    queue.offer(event(2))
    assert await queue.get() == event(2)
    # Behind a queued event, it overflows the bound as before.
    queue.offer(event(3))
    queue.offer(big_event(4, 4096))
    items = await drain(queue)
    end = items[-1]
    assert isinstance(end, StreamEnd) and end.error is not None
    assert end.error.reason == "SLOW_CONSUMER"


async def test_a_replay_larger_than_the_queue_waits_for_the_stream_instead_of_overflowing() -> None:
    stored = [big_event(sequence, 600) for sequence in range(1, 41)]

    async def read(session_id: str, after: int, limit: int) -> list[SessionEvent]:
        return [e for e in stored if e.sequence > after][:limit]

    hub = Hub(read, max_events=8, max_bytes=4096)
    queue = hub.new_queue("alice")
    hub.bind(queue, "s1", 0)
    replay = asyncio.ensure_future(hub.replay(queue, until_sequence=40))
    got: list[object] = []
    while len(got) < 40 and not (got and isinstance(got[-1], StreamEnd)):
        got.append(await asyncio.wait_for(queue.get(), 5))
    await replay
    assert got == stored
    assert not queue.closed
