"""The Chat stream's reader never dies in silence (decision 0183): an undecodable
message gets a reply and reading goes on; a request stream that breaks, or a failure
after the client half-closed, ends the stream with a status the client can act on.

The core's ``ChatStream`` is driven with the transport's own command conversion
(``service.transport.chat.commands``) and a real ``Hub``; its outbound queue shows how
the stream ends, as the Chat call would send it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from ballet.planner.v1 import chat_pb2

from ballet_common.grpc.status import from_status
from service.core.chat import ChatLimits, ChatService, ChatStream, ErrorReply
from service.core.errors import PlannerError, StoreUnavailable
from service.core.fanout import Hub, StreamEnd
from service.core.model import Session
from service.core.sessions import Caller
from service.transport.chat import commands, response_of
from service.transport.decoding import lenient
from service.transport.errors import failure_of


class Clock:
    def __init__(self) -> None:
        self.at = datetime(2026, 1, 1, tzinfo=UTC)

    def now(self) -> datetime:
        return self.at

    def monotonic(self) -> float:
        return 0.0


class Store:
    """The one store read the reader makes after the client half-closed."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    async def get_turn(self, turn_id: str) -> None:
        if self.error is not None:
            raise self.error


async def no_events(session_id: str, after: int, limit: int) -> list[Any]:
    return []


def new_stream(store: Store | None = None, *, expires_at: float = 2**40) -> ChatStream:
    service = ChatService(
        rules=Any,  # type: ignore[arg-type]  # not reached by these tests
        turns=Any,  # type: ignore[arg-type]
        hub=Hub(no_events),
        store=store or Store(),  # type: ignore[arg-type]
        clock=Clock(),
        limits=ChatLimits(),
    )
    return service.start_stream(Caller("alice", "acme", expires_at=expires_at))


def drained(stream: ChatStream) -> list[object]:
    items = [item for item, _size, _batch in stream.queue._items]
    stream.queue._items.clear()
    return items


async def ending(stream: ChatStream) -> PlannerError | None:
    while True:
        item = await asyncio.wait_for(stream.queue.get(), 5)
        if isinstance(item, StreamEnd):
            return item.error


async def requests_of(*items: Any) -> AsyncIterator[Any]:
    for item in items:
        yield item


async def test_an_undecodable_message_gets_a_reply_and_reading_goes_on() -> None:
    stream = new_stream()
    # request_id "r1", then cancel_turn.turn_id holding the byte 0xff.
    bad = lenient(chat_pb2.ChatRequest)(b"\x0a\x02r1" + b"\x22\x03\x0a\x01\xff")
    no_action = chat_pb2.ChatRequest(request_id="r2")  # a normal refusal
    await stream.read(commands(requests_of(bad, no_action)))
    first, second, end = drained(stream)
    stream.close()
    assert isinstance(first, ErrorReply) and isinstance(second, ErrorReply)
    reply = response_of(stream, first)
    assert reply.request_id == "r1"
    info = from_status(reply.error)
    assert info is not None and (info.reason, info.metadata["field"]) == (
        "INVALID_UTF8",
        "cancel_turn.turn_id",
    )
    reply = response_of(stream, second)
    assert reply.request_id == "r2"
    assert from_status(reply.error).reason == "ACTION_REQUIRED"  # type: ignore[union-attr]
    assert isinstance(end, StreamEnd) and end.error is None  # half-closed: a normal end


async def test_a_failing_request_stream_ends_the_stream_with_a_status() -> None:
    stream = new_stream()

    async def requests() -> AsyncIterator[Any]:
        yield chat_pb2.ChatRequest(request_id="r1")
        raise RuntimeError("the transport broke")

    await stream.read(commands(requests()))
    *_, end = drained(stream)
    stream.close()
    assert isinstance(end, StreamEnd) and end.error is not None
    assert end.error.reason == "REQUEST_STREAM_FAILED"


async def test_an_expired_token_ends_the_stream_on_the_next_message() -> None:
    stream = new_stream(expires_at=datetime(2025, 1, 1, tzinfo=UTC).timestamp())
    await stream.read(commands(requests_of(chat_pb2.ChatRequest(request_id="r1"))))
    error = await ending(stream)
    stream.close()
    assert error is not None and error.reason == "TOKEN_EXPIRED"


def waiting(stream: ChatStream) -> ChatStream:
    stream.session = Session.__new__(Session)
    object.__setattr__(stream.session, "session_id", "s1")
    stream.waiting_turn = "t1"
    return stream


async def test_a_failure_after_the_client_half_closed_ends_the_stream_with_its_status() -> None:
    stream = waiting(new_stream(Store(StoreUnavailable("down"))))
    reader = asyncio.get_running_loop().create_task(stream.read(commands(requests_of())))
    await asyncio.wait({reader})
    assert reader.exception() is None  # nothing escapes the reader
    error = await ending(stream)
    stream.close()
    assert error is not None and error.reason == "DATABASE_UNAVAILABLE"


async def test_a_bug_in_the_reader_ends_the_stream_internal_with_its_cause() -> None:
    stream = waiting(new_stream(Store(KeyError("a bug"))))
    reader = asyncio.get_running_loop().create_task(stream.read(commands(requests_of())))
    await asyncio.wait({reader})
    assert reader.exception() is None
    error = await ending(stream)
    stream.close()
    assert error is not None
    assert (failure_of(error).code.name, error.reason) == ("INTERNAL", "INTERNAL")
    assert isinstance(error.__cause__, KeyError)


async def test_an_idle_stream_gets_a_heartbeat_and_a_busy_one_none() -> None:
    hub = Hub(no_events, heartbeat_s=0.05)
    queue = hub.new_queue("alice")
    item = await asyncio.wait_for(queue.get(), 5)
    assert response_of(new_stream(), item).WhichOneof("event") == "heartbeat"
    # Items that flow reset the wait: no heartbeat while something is sent in time.
    queue.put_reply(ErrorReply(StoreUnavailable("x"), "r", ""))
    assert isinstance(await queue.get(), ErrorReply)
    hub.detach(queue)


async def test_a_half_closed_stream_gets_a_turn_end_stored_elsewhere_before_it_ends() -> None:
    """The end of the turn it waits for is stored (by another replica, whose signal has
    not come here yet): the stream delivers it from the store, then ends."""
    from dataclasses import replace

    from service.core.model import EventKind, TurnEndReason
    from service.core.turn.events import EventBuilder, Totals

    builder = EventBuilder("s1", "t1", "alice", Clock())  # type: ignore[arg-type]
    stored = [
        replace(builder.message_accepted("hi", "r1"), sequence=1),
        replace(builder.turn_ended(TurnEndReason.COMPLETED, Totals()), sequence=2),
    ]

    async def events_after(session_id: str, after: int, limit: int) -> list[Any]:
        return [e for e in stored if e.sequence > after][:limit]

    class EndedStore:
        async def get_turn(self, turn_id: str) -> Any:
            return type("Turn", (), {"end_reason": TurnEndReason.COMPLETED})()

    service = ChatService(
        rules=Any,  # type: ignore[arg-type]
        turns=Any,  # type: ignore[arg-type]
        hub=Hub(events_after),
        store=EndedStore(),  # type: ignore[arg-type]
        clock=Clock(),
        limits=ChatLimits(),
    )
    stream = waiting(service.start_stream(Caller("alice", "acme", expires_at=2**40)))
    service.hub.bind(stream.queue, "s1", 1)  # it had the acceptance, not the end
    await stream.read(commands(requests_of()))
    items = drained(stream)
    stream.close()
    kinds = [getattr(item, "kind", None) for item in items]
    assert kinds[0] is EventKind.TURN_ENDED
    assert isinstance(items[-1], StreamEnd) and items[-1].error is None


async def test_a_stream_that_sent_its_turns_end_reads_no_turn_when_half_closed() -> None:
    """Once the ``turn_ended`` of the turn it waits for was sent, a half-close ends the
    stream at once: no store read (the store here would fail one)."""
    from dataclasses import replace

    from service.core.model import TurnEndReason
    from service.core.turn.events import EventBuilder, Totals

    stream = waiting(new_stream(Store(AssertionError("the turn was read"))))
    builder = EventBuilder("s1", "t1", "alice", Clock())  # type: ignore[arg-type]
    accepted = replace(builder.message_accepted("hi", "r1"), sequence=1)
    ended = replace(builder.turn_ended(TurnEndReason.COMPLETED, Totals()), sequence=2)
    assert (stream.sent(accepted), stream.sent(ended)) == (False, False)  # not half-closed
    await stream.read(commands(requests_of()))
    items = drained(stream)
    stream.close()
    assert len(items) == 1 and isinstance(items[0], StreamEnd) and items[0].error is None
