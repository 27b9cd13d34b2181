"""The ``Chat`` stream's transport: client messages in, responses out, nothing more.

Each ``ChatRequest`` (or ``Undecodable`` message, ``service.transport.decoding``) becomes
a command of ``service.core.chat``, which holds every rule of the stream; what the
stream's queue hands out becomes a ``ChatResponse``; the queue's ``StreamEnd`` ends the
call with its status (``service.transport.errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import NoReturn, assert_never

from ballet.planner.v1 import chat_pb2

from service.core.chat import (
    AcceptedAgain,
    Cancel,
    ChatService,
    ChatStream,
    Command,
    ErrorReply,
    Open,
    Refused,
    Response,
    Send,
    SessionOpened,
)
from service.core.errors import InvalidArgument, PlannerError
from service.core.fanout import Heartbeat, StreamEnd
from service.core.model import SessionEvent, TextDelta, ToolCallProgress
from service.transport import convert
from service.transport.auth import Authenticator
from service.transport.decoding import Undecodable
from service.transport.errors import Context, abort, status_of

#: What the Chat handler reads: decoded requests, or the ones the decoder refused.
Requests = AsyncIterator[chat_pb2.ChatRequest | Undecodable]

#: How long a refused stream waits for the client's first message before ending.
_REFUSE_READ_S = 1.0


async def chat(
    service: ChatService, auth: Authenticator, requests: Requests, context: Context
) -> AsyncIterator[chat_pb2.ChatResponse]:
    """The bidirectional Chat call (an async generator of responses)."""
    try:
        stream = service.start_stream(auth.caller(context))
    except PlannerError as error:
        await _refuse(requests, context, error)
    reader = asyncio.get_running_loop().create_task(stream.read(commands(requests)))

    def end(_: object = None) -> None:  # also the call's done callback
        reader.cancel()
        stream.close()

    # However the call ends, even if this generator is never resumed again. (The stubs
    # type the callback as a class of their own that no function is.)
    context.add_done_callback(end)  # type: ignore[arg-type]
    try:
        while True:
            item = await stream.queue.get()
            if isinstance(item, StreamEnd):
                if item.error is not None:
                    await abort(context, item.error)
                return
            yield response_of(stream, item)
            if stream.sent(item):
                return
    finally:
        # Everything that must follow the stream happens before the first await, so a
        # second cancellation cannot skip it.
        end()
        # asyncio.wait does not raise the reader's CancelledError, and lets this task's
        # own cancellation through (never swallowed).
        await asyncio.wait({reader})


async def commands(requests: Requests) -> AsyncIterator[Command]:
    """The client's messages as the core's commands, in order."""
    async for request in requests:
        if isinstance(request, Undecodable):
            yield Refused(request.request_id, request.error())
            continue
        action = request.WhichOneof("action")
        if action == "open":
            opened = request.open
            yield Open(
                request.request_id,
                session_id=opened.session_id,
                project_id=opened.project_id,
                title=opened.title,
                after_sequence=opened.after_sequence,
            )
        elif action == "send_message":
            try:
                on_busy = convert.on_busy_from_proto(request.send_message.on_busy)
            except InvalidArgument as error:
                yield Refused(request.request_id, error)
                continue
            yield Send(request.request_id, request.send_message.text, on_busy)
        elif action == "cancel_turn":
            yield Cancel(request.request_id, request.cancel_turn.turn_id)
        else:
            yield Refused(
                request.request_id,
                InvalidArgument("the request has no action", reason="ACTION_REQUIRED"),
            )


def response_of(stream: ChatStream, item: Response) -> chat_pb2.ChatResponse:
    """The ``ChatResponse`` of one queued item (``StreamEnd`` ends the call instead)."""
    if isinstance(item, SessionEvent):
        response = convert.event_to_proto(item)
        response.request_id = stream.echo(item)
        return response
    if isinstance(item, TextDelta):
        return convert.text_delta_to_proto(item)
    if isinstance(item, ToolCallProgress):
        return convert.tool_call_progress_to_proto(item)
    if isinstance(item, Heartbeat):
        return chat_pb2.ChatResponse(heartbeat=chat_pb2.Heartbeat())
    if isinstance(item, SessionOpened):
        return convert.session_opened(item.session, item.request_id)
    if isinstance(item, ErrorReply):
        return convert.error_response(
            status_of(item.error), request_id=item.request_id, session_id=item.session_id
        )
    if isinstance(item, AcceptedAgain):
        response = convert.event_to_proto(item.event)
        response.request_id = item.request_id
        return response
    assert_never(item)


async def _refuse(requests: Requests, context: Context, error: Exception) -> NoReturn:
    """End a stream refused before it started (bad token, a service principal).

    Ending a bidirectional call while the client is still writing its first message can
    surface to that client as INTERNAL instead of our status; reading that message first
    (briefly) lets the real status through.
    """
    with contextlib.suppress(Exception):
        await asyncio.wait_for(anext(aiter(requests)), timeout=_REFUSE_READ_S)
    await abort(context, error)
