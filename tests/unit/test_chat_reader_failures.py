"""Whatever ends a Chat stream's reader ends the stream with a status and an ErrorInfo:
never silence, never an exception nobody retrieves (decision 0183). ``test_chat_reader.py`` covers
the client's message stream (undecodable messages, a stream that breaks); these cover what fails
after it, in the reader task.

The reader task (``service.transport.chat._read_requests``) is driven here with store
answers that make it fail, and the stream's outbound queue shows how the stream ends; the
Chat servicer aborts the call with that queue's end (``errors.abort``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from ballet.planner.v1 import chat_pb2

from ballet_common.tokens import Claims
from service.core.errors import PlannerError, StoreUnavailable
from service.core.fanout import StreamEnd, StreamQueue
from service.core.sessions import Caller
from service.transport.chat import ChatLimits, _read_requests, _Stream
from service.transport.errors import failure_of


class Store:
    """The one store read the reader makes after the client half-closed."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def get_turn(self, turn_id: str) -> None:
        raise self.error


def stream(store: Store | None = None) -> _Stream:
    rpcs: Any = SimpleNamespace(_limits=ChatLimits(), _store=store)
    claims = Claims("alice", "acme", "dev", frozenset({"ballet-planner"}), time.time() + 600)
    return _Stream(rpcs, claims, Caller("alice", "acme"), StreamQueue("", "alice", 0))


async def ending(queue: StreamQueue) -> PlannerError | None:
    while True:
        item = await asyncio.wait_for(queue.get(), 5)
        if isinstance(item, StreamEnd):
            return item.error


async def nothing() -> AsyncIterator[chat_pb2.ChatRequest]:
    return
    yield chat_pb2.ChatRequest()  # pragma: no cover


async def run_reader(chat: _Stream, requests: AsyncIterator[chat_pb2.ChatRequest]) -> None:
    reader = asyncio.get_running_loop().create_task(_read_requests(chat, requests))
    await asyncio.wait({reader})
    # Nothing escapes the reader: no exception for anyone to retrieve.
    assert reader.exception() is None


async def test_a_failure_after_the_client_half_closed_ends_the_stream_with_its_status() -> None:
    chat = stream(Store(StoreUnavailable("down")))
    chat.session = SimpleNamespace(session_id="s1")  # type: ignore[assignment]
    chat.waiting_turn = "t1"
    await run_reader(chat, nothing())
    error = await ending(chat.queue)
    assert error is not None and error.reason == "DATABASE_UNAVAILABLE"


async def test_a_bug_in_the_reader_ends_the_stream_internal_with_its_cause() -> None:
    chat = stream(Store(KeyError("a bug")))
    chat.session = SimpleNamespace(session_id="s1")  # type: ignore[assignment]
    chat.waiting_turn = "t1"
    await run_reader(chat, nothing())
    error = await ending(chat.queue)
    assert error is not None
    assert (failure_of(error).code.name, error.reason) == ("INTERNAL", "INTERNAL")
    assert isinstance(error.__cause__, KeyError)
