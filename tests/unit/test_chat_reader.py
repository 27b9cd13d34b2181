"""The Chat reader never dies in silence: an undecodable message gets a reply
and reading goes on; any other failure of the request stream ends the stream with a
status the client can act on."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from ballet.planner.v1 import chat_pb2

from ballet_common.grpc.status import from_status
from ballet_common.tokens import Claims
from service.core.fanout import StreamEnd, StreamQueue
from service.core.sessions import Caller
from service.transport.chat import ChatLimits, _Stream
from service.transport.decoding import lenient

CLAIMS = Claims("alice", "acme", "iss", frozenset({"ballet-planner"}), expires_at=2**40)


def reader() -> tuple[_Stream, StreamQueue]:
    queue = StreamQueue("", "alice", 0)
    rpcs: Any = SimpleNamespace(_limits=ChatLimits())
    return _Stream(rpcs, CLAIMS, Caller("alice", "acme"), queue), queue


def drained(queue: StreamQueue) -> list[object]:
    items = [item for item, _size, _batch in queue._items]
    queue._items.clear()
    return items


async def test_an_undecodable_message_gets_a_reply_and_reading_goes_on() -> None:
    stream, queue = reader()
    # request_id "r1", then cancel_turn.turn_id holding the byte 0xff.
    bad = lenient(chat_pb2.ChatRequest)(b"\x0a\x02r1" + b"\x22\x03\x0a\x01\xff")

    async def requests() -> AsyncIterator[Any]:
        yield bad
        yield chat_pb2.ChatRequest(request_id="r2")  # no action: a normal refusal

    await stream.read(requests())
    stream.close()
    first, second, end = drained(queue)
    assert isinstance(first, chat_pb2.ChatResponse) and first.request_id == "r1"
    info = from_status(first.error)
    assert info is not None and (info.reason, info.metadata["field"]) == (
        "INVALID_UTF8",
        "cancel_turn.turn_id",
    )
    assert isinstance(second, chat_pb2.ChatResponse) and second.request_id == "r2"
    assert isinstance(end, StreamEnd) and end.error is None  # half-closed: a normal end


async def test_a_failing_request_stream_ends_the_stream_with_a_status() -> None:
    stream, queue = reader()

    async def requests() -> AsyncIterator[Any]:
        yield chat_pb2.ChatRequest(request_id="r1")
        raise RuntimeError("the transport broke")

    await stream.read(requests())
    stream.close()
    *_, end = drained(queue)
    assert isinstance(end, StreamEnd) and end.error is not None
    assert end.error.reason == "REQUEST_STREAM_FAILED"
