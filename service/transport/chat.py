"""The turn RPCs: ``Chat`` (bidirectional), ``SendMessage`` and ``CancelTurn`` (SPEC 3).

Stream plumbing only: each client message becomes a call into the session rules or the
turn service; session events reach the stream through the process's ``Hub``. Replies
(``session_opened``, ``error``) go only to this stream and echo its ``request_id``.

The protocol rules of SPEC section 3 live here:

- a stream carries one session: ``send_message``/``cancel_turn`` before ``open``, or a
  second ``open``, gets a ``FAILED_PRECONDITION`` reply and the stream stays open;
- a stream that sends no ``open`` within ``open_timeout_s`` is closed;
- ``after_sequence`` beyond the last sequence is ``OUT_OF_RANGE``; a replay of more than
  ``max_replay_events`` is refused with ``REPLAY_TOO_LARGE`` (page with ListMessages);
- the token's ``exp`` is checked on every client message; once expired the stream ends
  ``UNAUTHENTICATED``/``TOKEN_EXPIRED``;
- ``open``, ``send_message`` and ``cancel_turn`` each re-check that the human may still
  read the session's project (cached at most 60 s; ``NOT_FOUND`` once they may not);
- a client message that cannot be decoded (``service.transport.decoding``) gets an
  ``INVALID_ARGUMENT`` reply (``INVALID_UTF8``) and the stream goes on; if reading the
  client's messages fails otherwise, the stream ends ``UNAVAILABLE``/
  ``REQUEST_STREAM_FAILED`` (reopen with ``after_sequence``), never in silence;
- a client that half-closes keeps receiving until the turn it started ends; a client
  that disconnects does not cancel anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from ballet.planner.v1 import chat_pb2, planner_service_pb2

from ballet_common.tokens import Claims
from service.core.errors import (
    FailedPrecondition,
    HumanRequired,
    Internal,
    InvalidArgument,
    OutOfRange,
    PlannerError,
    ResourceExhausted,
    StoreUnavailable,
    Unauthenticated,
    Unavailable,
)
from service.core.fanout import Hub, StreamEnd, StreamQueue
from service.core.ids import new_chat_request_id
from service.core.model import EventKind, Session, SessionEvent, TextDelta, ToolCallProgress
from service.core.outbound import CLIENT_MESSAGE_MAX_BYTES, messages_for_client
from service.core.ports import SessionStore
from service.core.sessions import Caller, SessionRules, check_request_id
from service.core.streams import StreamRegistry, StreamSlot
from service.core.turn import SendRequest, TurnService
from service.transport import convert
from service.transport.auth import Authenticator, caller_from_claims
from service.transport.decoding import Undecodable
from service.transport.errors import abort, rpc_errors, status_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatLimits:
    """Stream limits (SPEC sections 3 and 8)."""

    open_timeout_s: float = 30.0
    max_replay_events: int = 1000
    streams_per_human: int = 16
    #: The most bytes of messages a response carries (decision 0222).
    client_message_max_bytes: int = CLIENT_MESSAGE_MAX_BYTES


class TurnRpcs:
    """``Chat``, ``SendMessage`` and ``CancelTurn`` over the turn service (the
    ``TurnEndpoints`` of ``service.transport.sessions``)."""

    def __init__(
        self,
        *,
        rules: SessionRules,
        authenticator: Authenticator,
        turns: TurnService,
        hub: Hub,
        store: SessionStore,
        limits: ChatLimits,
        on_stream_change: Any = None,
        streams: StreamRegistry | None = None,
    ) -> None:
        """``streams`` counts open streams per human across replicas (SPEC 8); without
        it only this process's streams count (``Hub.stream_count``)."""
        self._rules = rules
        self._auth = authenticator
        self._turns = turns
        self._hub = hub
        self._store = store
        self._limits = limits
        self._on_stream_change = on_stream_change
        self._streams = streams

    # ----------------------------------------------------------------- unary

    async def send_message(
        self, request: planner_service_pb2.SendMessageRequest, context: Any
    ) -> planner_service_pb2.SendMessageResponse:
        """Run one whole turn and return its outcome and messages.

        When the caller's deadline passes the call ends ``DEADLINE_EXCEEDED`` and the turn
        goes on; ``GetTurn`` reads its outcome (SPEC section 3).
        """
        async with rpc_errors(context):
            claims = self._auth.authenticate(context)
            caller = caller_from_claims(claims)
            session = await self._rules.owned_session(caller, request.session_id)
            accepted = await self._turns.send_message(
                _send_request(session, caller, request.text, request.request_id)
            )
            turn = await self._turns.wait_for_end(accepted.turn.turn_id)
            stored = await self._store.turn_messages(turn.turn_id)
            messages = messages_for_client(stored, self._limits.client_message_max_bytes)
            return planner_service_pb2.SendMessageResponse(
                turn=convert.turn_to_proto(turn),
                messages=[convert.message_to_proto(m) for m in messages],
            )

    async def cancel_turn(
        self, request: planner_service_pb2.CancelTurnRequest, context: Any
    ) -> planner_service_pb2.CancelTurnResponse:
        """Cancel a turn; an ended turn is returned unchanged, an unknown one is
        ``NOT_FOUND``."""
        async with rpc_errors(context):
            caller = self._auth.caller(context)
            check_request_id(request.request_id, required=False)
            session = await self._rules.owned_session(caller, request.session_id)
            turn = await self._turns.cancel(session, request.turn_id)
            return planner_service_pb2.CancelTurnResponse(turn=convert.turn_to_proto(turn))

    def session_deleted(self, session_id: str) -> None:
        """After ``DeleteSession``: stop the session's turn running here and end the
        streams attached here with ``NOT_FOUND`` (SPEC 3). Other replicas hear it from
        the notifier, which skips this replica's own notifications."""
        self._turns.on_session_deleted(session_id)
        self._hub.session_deleted(session_id)

    # ----------------------------------------------------------------- Chat

    async def chat(
        self, requests: AsyncIterator[chat_pb2.ChatRequest | Undecodable], context: Any
    ) -> AsyncIterator[chat_pb2.ChatResponse]:
        """The bidirectional Chat stream (an async generator of responses)."""
        try:
            claims = self._auth.authenticate(context)
        except PlannerError as error:
            await _refuse(requests, context, error)
        caller = caller_from_claims(claims)
        if caller.is_service:
            await _refuse(
                requests,
                context,
                HumanRequired("Chat needs a human's token; service principals may only read"),
            )
        slot = await self._take_slot(caller, requests, context)
        queue = self._hub.new_queue(caller.subject)
        stream = _Stream(self, claims, caller, queue)
        reader = asyncio.get_running_loop().create_task(_read_requests(stream, requests))
        end = self._ending(stream, reader, slot)
        # However the call ends, even if this generator is never resumed again.
        context.add_done_callback(lambda _: end())
        self._stream_changed(+1)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, StreamEnd):
                    if item.error is not None:
                        await abort(context, item.error)
                    return
                if isinstance(item, SessionEvent):
                    yield convert.event_to_proto(item)
                    if (
                        item.kind is EventKind.TURN_ENDED
                        and stream.half_closed
                        and stream.waiting_turn in ("", item.turn_id)
                    ):
                        return
                elif isinstance(item, TextDelta):
                    yield convert.text_delta_to_proto(item)
                elif isinstance(item, ToolCallProgress):
                    yield convert.tool_call_progress_to_proto(item)
                else:
                    assert isinstance(item, chat_pb2.ChatResponse)
                    yield item
        finally:
            # Everything that must follow the stream happens before the first await, so
            # a second cancellation cannot skip it.
            end()
            # asyncio.wait does not raise the reader's CancelledError, and lets this
            # task's own cancellation through (never swallowed; STYLE rule 5).
            await asyncio.wait({reader})

    async def _take_slot(
        self,
        caller: Caller,
        requests: AsyncIterator[chat_pb2.ChatRequest | Undecodable],
        context: Any,
    ) -> StreamSlot | None:
        """Admit the caller's stream against the per-human limit (SPEC 8), or refuse the
        call (``TOO_MANY_STREAMS``, ``DATABASE_UNAVAILABLE``). The slot is released when
        the call ends, however it ends: a call cancelled while its slot is being taken
        leaves no row behind (issue 12; decision 0182)."""
        if self._streams is not None:
            slot = self._streams.open(caller.subject)
            context.add_done_callback(lambda _: slot.release())
            try:
                await slot.admitted()
            except PlannerError as error:
                await _refuse(requests, context, error)
            return slot
        if self._hub.stream_count(caller.subject) >= self._limits.streams_per_human:
            await _refuse(
                requests,
                context,
                ResourceExhausted(
                    f"at most {self._limits.streams_per_human} open Chat streams per human",
                    reason="TOO_MANY_STREAMS",
                    retry_after_s=1.0,
                ),
            )
        return None

    def _ending(
        self, stream: _Stream, reader: asyncio.Task[None], slot: StreamSlot | None
    ) -> Callable[[], None]:
        """What must follow a stream, as one synchronous, idempotent call: stop its
        reader and tasks, detach its queue, release its slot, count it closed."""
        ended = False

        def end() -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            reader.cancel()
            stream.close()
            self._hub.detach(stream.queue)
            if slot is not None:
                slot.release()
            self._stream_changed(-1)

        return end

    def _stream_changed(self, delta: int) -> None:
        if self._on_stream_change is not None:
            self._on_stream_change(delta)


class _Stream:
    """The state of one Chat stream: its session, its caller, and the reader."""

    def __init__(self, rpcs: TurnRpcs, claims: Claims, caller: Caller, queue: StreamQueue) -> None:
        self._rpcs = rpcs
        self._claims = claims
        self._caller = caller
        self._queue = queue
        self.session: Session | None = None
        self.half_closed = False
        self.waiting_turn = ""
        self._open_timer = asyncio.get_running_loop().call_later(
            rpcs._limits.open_timeout_s, self._open_timed_out
        )
        self._tasks: set[asyncio.Task[None]] = set()

    def close(self) -> None:
        self._open_timer.cancel()
        for task in self._tasks:
            task.cancel()

    def _open_timed_out(self) -> None:
        if self.session is None:
            self._queue.end(
                FailedPrecondition(
                    "no open within the time allowed; the stream is closed",
                    reason="OPEN_TIMEOUT",
                )
            )

    async def read(self, requests: AsyncIterator[chat_pb2.ChatRequest | Undecodable]) -> None:
        try:
            async for request in requests:
                if self._claims.expired():
                    self._queue.end(
                        Unauthenticated(
                            "the token has expired; reopen with a fresh token and after_sequence",
                            reason="TOKEN_EXPIRED",
                        )
                    )
                    return
                if isinstance(request, Undecodable):
                    log.info("chat: refused an undecodable message: field=%s", request.field or "-")
                    self._reply_error(request.error(), request.request_id)
                    continue
                try:
                    await self._handle(request)
                except PlannerError as error:
                    self._reply_error(error, request.request_id)
                except Exception as error:
                    # StoreUnavailable and bugs: the reply says so; the stream stays open.
                    self._reply_error(error, request.request_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            # Usually the client went away mid-read and the call is over anyway; if not,
            # the stream must not stay open with nobody reading: end it with a status
            # the client can act on (reopen with after_sequence).
            log.debug("chat stream reader ended", exc_info=True)
            self._queue.end(
                Unavailable(
                    "reading the stream's messages failed; reopen with after_sequence",
                    reason="REQUEST_STREAM_FAILED",
                )
            )
            return
        self.half_closed = True
        if self.session is None or not self.waiting_turn:
            self._queue.end(None)
        else:
            try:
                turn = await self._rpcs._store.get_turn(self.waiting_turn)
            except StoreUnavailable as error:
                # Whether the turn ended is unknown: say so, and the client reopens with
                # after_sequence (an escaping error would end the call UNKNOWN later).
                self._queue.end(error)
                return
            if turn is None or turn.end_reason is not None:
                self._queue.end(None)

    @property
    def queue(self) -> StreamQueue:
        """The stream's outbound queue."""
        return self._queue

    def fail(self, error: Exception) -> None:
        """End the stream with ``error``'s status (after what is queued)."""
        if isinstance(error, PlannerError):
            ending = error
        else:
            # A bug: mapped to INTERNAL, and logged with this cause by the error table.
            ending = Internal("internal error", reason="INTERNAL")
            ending.__cause__ = error
        self._queue.end(ending)

    def _reply_error(self, error: Exception, request_id: str) -> None:
        self._queue.put_reply(
            convert.error_response(
                status_of(error),
                request_id=request_id,
                session_id=self.session.session_id if self.session else "",
            )
        )

    async def _handle(self, request: chat_pb2.ChatRequest) -> None:
        action = request.WhichOneof("action")
        if action == "open":
            await self._open(request)
        elif action == "send_message":
            await self._send(request)
        elif action == "cancel_turn":
            self._require_open()
            task = asyncio.get_running_loop().create_task(self._cancel(request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            raise InvalidArgument("the request has no action", reason="ACTION_REQUIRED")

    def _require_open(self) -> Session:
        if self.session is None:
            raise FailedPrecondition("send open first", reason="NOT_OPEN")
        return self.session

    async def _open(self, request: chat_pb2.ChatRequest) -> None:
        if self.session is not None:
            raise FailedPrecondition("this stream already has a session", reason="ALREADY_OPEN")
        action = request.open
        check_request_id(request.request_id, required=False)
        if action.after_sequence < 0:
            raise InvalidArgument("after_sequence must not be negative", reason="INVALID_SEQUENCE")
        rules = self._rpcs._rules
        if action.session_id:
            session = await rules.owned_session(self._caller, action.session_id)
            if action.project_id and action.project_id != session.project_id:
                raise InvalidArgument(
                    "project_id names another project than the session's; send one or the "
                    "other",
                    reason="PROJECT_MISMATCH",
                )
        else:
            session = await rules.create_session(
                self._caller,
                request_id=request.request_id or new_chat_request_id(),
                project_id=action.project_id,
                title=action.title,
            )
        if action.after_sequence > session.last_sequence:
            raise OutOfRange(
                f"after_sequence {action.after_sequence} is beyond the last sequence "
                f"{session.last_sequence}",
                reason="SEQUENCE_OUT_OF_RANGE",
                metadata={"last_sequence": str(session.last_sequence)},
            )
        replay = session.last_sequence - action.after_sequence
        if replay > self._rpcs._limits.max_replay_events:
            raise FailedPrecondition(
                f"{replay} events to replay; at most {self._rpcs._limits.max_replay_events}: "
                "page with ListMessages, then open with a recent after_sequence",
                reason="REPLAY_TOO_LARGE",
                metadata={"last_sequence": str(session.last_sequence)},
            )
        self.session = session
        self._open_timer.cancel()
        # The reply first, then the replay, then live events: no await in between
        # binding and the reply, so no live event can overtake it.
        self._queue.put_reply(convert.session_opened(session, request.request_id))
        hub = self._rpcs._hub
        hub.bind(self._queue, session.session_id, action.after_sequence)
        await hub.replay(self._queue, session.last_sequence)

    async def _send(self, request: chat_pb2.ChatRequest) -> None:
        session = self._require_open()
        # The session was found owned by this caller at open, and its owner never
        # changes; the project access is re-checked (cached), and a session deleted
        # since is refused by the store when the message is stored (SESSION_NOT_FOUND).
        await self._rpcs._rules.recheck_project(self._caller, session)
        accepted = await self._rpcs._turns.send_message(
            _send_request(session, self._caller, request.send_message.text, request.request_id)
        )
        self.waiting_turn = accepted.turn.turn_id
        if accepted.duplicate:
            # A duplicate stores nothing: this stream alone hears the original again.
            reply = convert.event_to_proto(accepted.message_accepted)
            reply.request_id = request.request_id
            self._queue.put_reply(reply)

    async def _cancel(self, request: chat_pb2.ChatRequest) -> None:
        session = self._require_open()
        try:
            check_request_id(request.request_id, required=False)
            rules = self._rpcs._rules
            if request.cancel_turn.turn_id:
                # The human's access to the project is re-checked on every action.
                await rules.recheck_project(self._caller, session)
            else:
                # "The running turn": the session read at open predates it, so read it
                # now (which re-checks the project too).
                session = await rules.owned_session(self._caller, session.session_id)
            await self._rpcs._turns.cancel(session, request.cancel_turn.turn_id)
        except PlannerError as error:
            self._reply_error(error, request.request_id)
        except Exception as error:
            self._reply_error(error, request.request_id)


async def _read_requests(
    stream: _Stream, requests: AsyncIterator[chat_pb2.ChatRequest | Undecodable]
) -> None:
    """The reader task of a Chat stream. Whatever ends it, but the cancellation that
    stops it, ends the stream with a status and an ErrorInfo: never silence, and never an
    exception nobody retrieves (issue 12)."""
    try:
        await stream.read(requests)
    except Exception as error:
        stream.fail(error)


#: How long a refused stream waits for the client's first message before ending.
_REFUSE_READ_S = 1.0


async def _refuse(
    requests: AsyncIterator[chat_pb2.ChatRequest | Undecodable], context: Any, error: Exception
) -> NoReturn:
    """End a stream refused before it started (bad token, limits).

    Ending a bidirectional call while the client is still writing its first message can
    surface to that client as INTERNAL instead of our status; reading that message first
    (briefly) lets the real status through.
    """
    with contextlib.suppress(Exception):
        await asyncio.wait_for(anext(aiter(requests)), timeout=_REFUSE_READ_S)
    await abort(context, error)


def _send_request(session: Session, caller: Caller, text: str, request_id: str) -> SendRequest:
    if caller.is_service:
        raise HumanRequired("sending needs the session owner's token")
    return SendRequest(
        session=session,
        human_id=caller.subject,
        organization_id=caller.organization_id,
        token=caller.token,
        text=text,
        request_id=request_id,
    )
