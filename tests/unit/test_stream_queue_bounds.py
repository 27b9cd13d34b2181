"""The bound of a stream's outbound queue counts how far its client is behind, not the
size of one event (decision 0220), and what a client is sent is cut to fit it (0222).

A client that keeps up takes every batch (one commit's events) whole however large its
events are; one that stops taking falls behind by the batches after the one it is
delivering, and ends ``SLOW_CONSUMER`` once they pass the bound.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from service.core.fanout import Hub, StreamEnd, StreamQueue
from service.core.model import EventKind, Message, MessageKind, SessionEvent, TextDelta

NOW = datetime(2026, 1, 1, tzinfo=UTC)
KiB = 1024
MiB = 1024 * KiB


def call_event(sequence: int, arguments_bytes: int) -> SessionEvent:
    message = Message(
        session_id="s1",
        turn_id="t1",
        message_id=f"m{sequence}",
        kind=MessageKind.TOOL_CALL,
        create_time=NOW,
        tool_call_id=f"call_{sequence}",
        tool_name="propose_changeset",
        tool_arguments='{"title":"' + "x" * arguments_bytes + '"}',
    )
    return SessionEvent(
        "s1", "t1", EventKind.TOOL_CALL_STARTED, NOW, message=message
    ).with_sequence(sequence)


def result_event(sequence: int) -> SessionEvent:
    message = Message(
        session_id="s1",
        turn_id="t1",
        message_id=f"m{sequence}",
        kind=MessageKind.TOOL_RESULT,
        create_time=NOW,
        tool_call_id=f"call_{sequence - 1}",
        tool_name="propose_changeset",
        tool_result='{"changeset_id":"cs-1"}',
    )
    return SessionEvent(
        "s1", "t1", EventKind.TOOL_CALL_FINISHED, NOW, message=message
    ).with_sequence(sequence)


async def take(queue: StreamQueue, count: int) -> list[object]:
    return [await asyncio.wait_for(queue.get(), 5) for _ in range(count)]


async def test_one_commit_with_a_call_over_the_byte_bound_reaches_a_stream_that_keeps_up() -> None:
    # The failure this bound replaces: the started and finished events of one call of
    # 1.5 MiB ended every stream, since together they passed 1 MiB.
    queue = StreamQueue("s1", "alice", last_sequence=0)
    queue.offer_batch([call_event(1, 3 * MiB // 2), result_event(2)])
    got = await take(queue, 2)
    assert [e.sequence for e in got if isinstance(e, SessionEvent)] == [1, 2]
    assert not queue.closed


async def test_sixteen_large_calls_of_one_answer_are_one_batch() -> None:
    queue = StreamQueue("s1", "alice", last_sequence=0)
    batch = [call_event(sequence, MiB) for sequence in range(1, 17)]
    queue.offer_batch(batch)
    assert await take(queue, 16) == batch
    assert not queue.closed


async def test_a_write_round_stored_in_several_commits_reaches_a_stream_that_keeps_up() -> None:
    # Calls that write are stored first (one commit), each result as it comes (one
    # commit each); the stream is still sending the first call when the results arrive.
    queue = StreamQueue("s1", "alice", last_sequence=0)
    queue.offer_batch([call_event(1, MiB), call_event(2, MiB), call_event(3, MiB)])
    first = await queue.get()
    assert isinstance(first, SessionEvent) and first.sequence == 1
    for sequence in (4, 5, 6):
        queue.offer_batch([result_event(sequence)])
    got = await take(queue, 5)
    assert [e.sequence for e in got if isinstance(e, SessionEvent)] == [2, 3, 4, 5, 6]
    assert not queue.closed


async def test_a_stream_that_stops_taking_ends_slow_consumer_once_it_is_a_bound_behind() -> None:
    queue = StreamQueue("s1", "alice", last_sequence=0, max_bytes=64 * KiB)
    queue.offer_batch([call_event(1, 100 * KiB), result_event(2)])  # being delivered
    queue.offer_batch([call_event(3, 40 * KiB)])  # 40 KiB behind: fits
    assert not queue.closed and queue.behind_bytes < 64 * KiB
    queue.offer_batch([call_event(4, 40 * KiB)])  # 80 KiB behind: over
    assert queue.closed
    end = await queue.get()
    assert isinstance(end, StreamEnd) and end.error is not None
    assert end.error.reason == "SLOW_CONSUMER"
    assert end.error.metadata == {"last_sequence": "0"}


async def test_a_stream_that_takes_nothing_overflows_the_event_count_too() -> None:
    queue = StreamQueue("s1", "alice", last_sequence=0, max_events=4)
    queue.offer_batch([result_event(1)])  # being delivered
    queue.offer_batch([result_event(sequence) for sequence in range(2, 6)])
    assert not queue.closed and queue.behind_items == 4
    queue.offer_batch([result_event(6)])
    assert queue.closed


async def test_a_catch_up_read_longer_than_the_event_bound_reaches_a_stream_that_keeps_up() -> None:
    # Decision 0225: a follower that heard of a turn's commits late (no notification
    # yet) reads them all at once; that one read is not a sign of a slow client.
    stored = [result_event(sequence) for sequence in range(1, 23)]

    async def read(session_id: str, after: int, limit: int) -> list[SessionEvent]:
        return [e for e in stored if e.sequence > after][:limit]

    hub = Hub(read, max_events=16)
    queue = hub.new_queue("alice")
    hub.bind(queue, "s1", 0)
    await hub.on_remote_events("s1", 22)
    got = await take(queue, 22)
    assert [e.sequence for e in got if isinstance(e, SessionEvent)] == list(range(1, 23))
    assert not queue.closed


async def test_merged_deltas_stay_within_the_byte_bound() -> None:
    queue = StreamQueue("s1", "alice", last_sequence=0, max_bytes=8 * KiB)
    offset = 0
    for _ in range(100):
        queue.offer_delta(TextDelta("s1", "t1", "m1", offset, "y" * 1000))
        offset += 1000
    # The delta being delivered, and at most the bound behind it; the rest are dropped
    # (the assistant_message carries the text).
    got: list[object] = []
    while queue._items:
        got.append(await queue.get())
    assert len(got) == 2 and not queue.closed
    assert all(isinstance(d, TextDelta) and 0 < len(d.text) <= 8 * KiB for d in got)
    assert next(d.offset for d in got if isinstance(d, TextDelta)) == 0


def big_answer(sequence: int, size: int) -> SessionEvent:
    message = Message(
        session_id="s1",
        turn_id="t1",
        message_id=f"m{sequence}",
        kind=MessageKind.ASSISTANT,
        create_time=NOW,
        text="z" * size,
    )
    return SessionEvent(
        "s1", "t1", EventKind.ASSISTANT_MESSAGE, NOW, message=message
    ).with_sequence(sequence)


async def no_events(session_id: str, after: int, limit: int) -> list[SessionEvent]:
    return []


async def test_the_hub_sends_every_stream_an_oversized_event_cut_and_marked() -> None:
    hub = Hub(no_events, client_message_max_bytes=256 * KiB)
    queues = [hub.attach("s1", "alice", 0) for _ in range(2)]
    stored = big_answer(1, MiB)
    hub.publish([stored])
    sent = [await queue.get() for queue in queues]
    assert sent[0] is sent[1]  # cut once, for every stream
    assert isinstance(sent[0], SessionEvent) and sent[0].message is not None
    message = sent[0].message
    assert message.truncated and message.original_bytes == MiB
    assert message.text == "z" * len(message.text) and message.size_bytes() < 256 * KiB
    assert stored.message is not None and not stored.message.truncated


async def test_a_replay_sends_an_oversized_event_cut_and_marked() -> None:
    stored = [big_answer(1, MiB), result_event(2)]

    async def read(session_id: str, after: int, limit: int) -> list[SessionEvent]:
        return [e for e in stored if e.sequence > after][:limit]

    hub = Hub(read, client_message_max_bytes=256 * KiB)
    queue = hub.new_queue("alice")
    hub.bind(queue, "s1", 0)
    await hub.replay(queue, until_sequence=2)
    first, second = await take(queue, 2)
    assert isinstance(first, SessionEvent) and first.message is not None
    assert first.message.truncated and first.message.original_bytes == MiB
    assert second == stored[1]


async def test_the_catch_up_delta_of_a_long_answer_keeps_its_end() -> None:
    hub = Hub(no_events, client_message_max_bytes=64 * KiB)
    hub.publish_delta(TextDelta("s1", "t1", "m1", 0, "a" * (100 * KiB)))
    hub.publish_delta(TextDelta("s1", "t1", "m1", 100 * KiB, "b" * 10))
    queue = hub.new_queue("alice")
    hub.bind(queue, "s1", 0)
    await hub.replay(queue, until_sequence=0)
    delta = await queue.get()
    assert isinstance(delta, TextDelta)
    assert delta.text.endswith("b" * 10) and len(delta.text) < 64 * KiB
    assert delta.offset + len(delta.text) == 100 * KiB + 10


async def test_a_catch_up_longer_than_one_read_reaches_a_stream_that_keeps_up() -> None:
    # Decision 0226: a follower 1,600 events behind reads them 500 at a time; each read
    # waits for the stream to take the one before, so a stream that reads is not ended
    # however far its replica is behind (before: three reads queued at once overflowed).
    stored = [result_event(sequence) for sequence in range(1, 1601)]

    async def read(session_id: str, after: int, limit: int) -> list[SessionEvent]:
        await asyncio.sleep(0)
        return [e for e in stored if e.sequence > after][:limit]

    hub = Hub(read, max_events=600)
    queue = hub.new_queue("alice")
    hub.bind(queue, "s1", 0)
    reading = asyncio.create_task(take(queue, 1600))
    await hub.on_remote_events("s1", 1600)
    got = await asyncio.wait_for(reading, 10)
    assert [e.sequence for e in got if isinstance(e, SessionEvent)] == list(range(1, 1601))
    assert not queue.closed


async def test_a_catch_up_still_ends_a_stream_that_does_not_read() -> None:
    stored = [result_event(sequence) for sequence in range(1, 1601)]

    async def read(session_id: str, after: int, limit: int) -> list[SessionEvent]:
        return [e for e in stored if e.sequence > after][:limit]

    hub = Hub(read, max_events=600, catch_up_wait_s=0.01)
    queue = hub.new_queue("alice")
    hub.bind(queue, "s1", 0)
    await hub.on_remote_events("s1", 1600)
    # The first read is taken whole, the next 500 fit behind it, the third does not.
    for _ in range(200):
        if queue.closed:
            break
        await asyncio.sleep(0.01)
    assert queue.closed
    assert queue.delivered_sequence == 0
