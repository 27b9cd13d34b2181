"""The Chat protocol: what one bidirectional stream may do, and in what order.

The transport (``service.transport.chat``) only pumps: it turns each client message into
a ``Command``, hands the commands to a ``ChatStream`` and sends what the stream's queue
hands out. The rules live here (docs/spec/api-and-streams.md):

- a stream carries one session: ``Send``/``Cancel`` before ``Open``, or a second
  ``Open``, gets a ``FAILED_PRECONDITION`` reply and the stream stays open;
- a stream that sends no ``Open`` within ``open_timeout_s`` is closed (``OPEN_TIMEOUT``);
- ``Open`` checks that the human may read the session's project first, and only then
  takes the stream's slot in the per-human count (``TOO_MANY_STREAMS`` ends the stream),
  so a human without access never holds a slot;
- ``after_sequence`` beyond the last sequence is ``OUT_OF_RANGE``; a replay of more than
  ``max_replay_events`` is refused with ``REPLAY_TOO_LARGE`` (page with ListMessages);
- the token's ``exp`` is checked on every client message; once expired the stream ends
  ``UNAUTHENTICATED``/``TOKEN_EXPIRED``;
- ``Send`` and ``Cancel`` re-check the human's access to the project (cached);
- the sending stream's live ``message_accepted`` echoes the ``request_id`` of the
  message (``ChatStream.echo``); a duplicate gets the original event again, for that
  stream alone (AIP-155);
- a client message that could not be decoded is a ``Refused`` command: an error reply,
  and the stream goes on; if reading the client's messages fails otherwise, the stream
  ends ``UNAVAILABLE``/``REQUEST_STREAM_FAILED``, never in silence;
- a client that half-closes keeps receiving until the turn it started ends; a client
  that disconnects cancels nothing.

Cancellation safety: everything that must follow a stream is one synchronous,
idempotent ``ChatStream.close`` (timer, tasks, hub, slot, count), which the transport
calls from the RPC's done callback as well as when the stream ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import assert_never

from service.core.client_copy import CLIENT_MESSAGE_MAX_BYTES, messages_for_client
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
from service.core.fanout import Heartbeat, Hub, StreamEnd, StreamQueue
from service.core.ids import new_id
from service.core.model import (
    EventKind,
    Message,
    OnBusy,
    Session,
    SessionEvent,
    TextDelta,
    ToolCallProgress,
    Turn,
)
from service.core.ports import Clock, SessionStore
from service.core.sessions import Caller, SessionRules, check_request_id
from service.core.streams import StreamRegistry, StreamSlot
from service.core.turn import SendRequest, TurnService

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionOpened:
    """The reply to ``open``: the stream is attached to ``session``."""

    session: Session
    request_id: str


@dataclass(frozen=True)
class ErrorReply:
    """A client message was refused; the stream goes on. ``error`` is mapped to its
    status by the transport's one error table."""

    error: Exception
    request_id: str
    session_id: str


@dataclass(frozen=True)
class AcceptedAgain:
    """A duplicate ``send_message``: the original ``message_accepted`` again, for the
    sending stream alone, echoing its ``request_id`` (AIP-155)."""

    event: SessionEvent
    request_id: str


#: What goes only to the stream whose client message it answers (``sequence`` 0).
Reply = SessionOpened | ErrorReply | AcceptedAgain
#: What a stream sends its client, one ``ChatResponse`` each.
Response = SessionEvent | TextDelta | ToolCallProgress | Reply | Heartbeat
#: Everything a stream's queue hands out, in the order the stream sends it.
Outbound = Response | StreamEnd


# ---------------------------------------------------------------------- commands


@dataclass(frozen=True)
class Open:
    """Attach the stream to ``session_id``, or to a new session of ``project_id`` titled
    ``title`` when ``session_id`` is empty; replay the events after ``after_sequence``."""

    request_id: str
    session_id: str = ""
    project_id: str = ""
    title: str = ""
    after_sequence: int = 0


@dataclass(frozen=True)
class Send:
    """Send a human message to the attached session (starts a turn, or with ``on_busy``
    queues it while one runs; decision 0300)."""

    request_id: str
    text: str
    on_busy: OnBusy = OnBusy.REJECT


@dataclass(frozen=True)
class Cancel:
    """Cancel ``turn_id`` of the attached session; empty: the running turn."""

    request_id: str
    turn_id: str = ""


@dataclass(frozen=True)
class Refused:
    """A client message refused before it became a command (undecodable, no action):
    answered with ``error`` as a reply; the stream goes on."""

    request_id: str
    error: PlannerError


Command = Open | Send | Cancel | Refused


@dataclass(frozen=True)
class ChatLimits:
    """Stream limits (docs/spec/limits.md)."""

    #: Seconds a stream may stay without ``Open`` before it is closed.
    open_timeout_s: float = 30.0
    #: The most stored events an ``Open`` replays.
    max_replay_events: int = 1000
    #: Open streams per human when no cross-replica registry counts them.
    streams_per_human: int = 16
    #: The most bytes of messages a response carries (decision 0222).
    client_message_max_bytes: int = CLIENT_MESSAGE_MAX_BYTES


class ChatService:
    """The turn side of the API: the Chat streams, and the unary ``SendMessage`` and
    ``CancelTurn``. One per process."""

    def __init__(
        self,
        *,
        rules: SessionRules,
        turns: TurnService,
        hub: Hub,
        store: SessionStore,
        clock: Clock,
        limits: ChatLimits,
        streams: StreamRegistry | None = None,
        on_stream_change: Callable[[int], None] | None = None,
    ) -> None:
        """``streams`` counts open streams per human across replicas; without it only
        this process's attached streams count (``Hub.stream_count``).
        ``on_stream_change`` hears +1 when a stream starts and -1 when it ends."""
        self.rules = rules
        self.turns = turns
        self.hub = hub
        self.store = store
        self.clock = clock
        self.limits = limits
        self.streams = streams
        self._on_stream_change = on_stream_change

    def start_stream(self, caller: Caller) -> ChatStream:
        """A new stream of ``caller``, not yet attached to a session. Raises
        ``PermissionDenied``/``HUMAN_REQUIRED`` for a service principal (Chat acts as a
        human)."""
        if caller.is_service:
            raise HumanRequired("Chat needs a human's token; service principals may only read")
        stream = ChatStream(self, caller)
        self._stream_changed(+1)
        return stream

    def _stream_changed(self, delta: int) -> None:
        if self._on_stream_change is not None:
            self._on_stream_change(delta)

    async def send_message(
        self,
        caller: Caller,
        session_id: str,
        text: str,
        request_id: str,
        on_busy: OnBusy = OnBusy.REJECT,
    ) -> tuple[Turn, list[Message]]:
        """``SendMessage``: run one whole turn; returns it ended, with its messages as a
        client is sent them. When the caller goes away the turn goes on (``GetTurn``
        reads its outcome). A message queued behind a running turn (``on_busy``) is
        answered at once: the turn in state QUEUED, no messages (decision 0300). Raises
        what ``SessionRules.owned_session`` and ``TurnService.send_message`` raise."""
        session = await self.rules.owned_session(caller, session_id)
        accepted = await self.turns.send_message(
            _send_request(session, caller, text, request_id, on_busy)
        )
        if accepted.queued:
            return accepted.turn, []
        turn = await self.turns.wait_for_end(accepted.turn.turn_id)
        stored = await self.store.turn_messages(turn.turn_id)
        return turn, messages_for_client(stored, self.limits.client_message_max_bytes)

    async def cancel_turn(
        self, caller: Caller, session_id: str, turn_id: str, request_id: str
    ) -> Turn:
        """``CancelTurn``: an ended turn is returned unchanged, an unknown one is
        ``NOT_FOUND``."""
        check_request_id(request_id, required=False)
        session = await self.rules.owned_session(caller, session_id)
        return await self.turns.cancel(session, turn_id)

    def session_deleted(self, session_id: str) -> None:
        """After ``DeleteSession`` or retention: stop the session's turn running here and
        end the streams attached here with ``NOT_FOUND``."""
        self.turns.on_session_deleted(session_id)
        self.hub.session_deleted(session_id)


class ChatStream:
    """One Chat stream: its caller, its session once opened, its outbound queue.

    The transport runs ``read`` as the stream's reader task, sends what ``queue.get``
    returns (``echo`` gives the request id of a live ``message_accepted``), asks
    ``sent`` after each item, and calls ``close`` however the call ends.
    """

    def __init__(self, service: ChatService, caller: Caller) -> None:
        self._service = service
        self._caller = caller
        self.queue: StreamQueue = service.hub.new_queue(caller.subject)
        self.session: Session | None = None
        self.half_closed = False
        #: The turn started by this stream's last message (half-close waits for it).
        self.waiting_turn = ""
        # The turn whose turn_ended this stream sent last.
        self._ended_turn = ""
        # Request ids of messages sent here whose live message_accepted is not out yet.
        self._sending: set[str] = set()
        self._slot: StreamSlot | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._open_timer = asyncio.get_running_loop().call_later(
            service.limits.open_timeout_s, self._open_timed_out
        )

    # ----------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """What must follow the stream, however it ends: stop its timer and tasks,
        detach its queue, release its slot, count it closed. Synchronous and idempotent
        (it runs from the RPC's done callback too)."""
        if self._closed:
            return
        self._closed = True
        self._open_timer.cancel()
        for task in self._tasks:
            task.cancel()
        self._service.hub.detach(self.queue)
        if self._slot is not None:
            self._slot.release()
        self._service._stream_changed(-1)

    def sent(self, item: Outbound) -> bool:
        """Note that ``item`` was sent; whether the stream now ends cleanly: the client
        half-closed and this is the end of the turn it was waiting for."""
        if not (isinstance(item, SessionEvent) and item.kind is EventKind.TURN_ENDED):
            return False
        self._ended_turn = item.turn_id
        return self.half_closed and self.waiting_turn in ("", item.turn_id)

    def echo(self, event: SessionEvent) -> str:
        """The request id to send with a live event: that of a ``message_accepted`` of
        a message this stream sent (once), else empty."""
        request_id = event.request_id
        if request_id and request_id in self._sending:
            self._sending.discard(request_id)
            return request_id
        return ""

    def fail(self, error: Exception) -> None:
        """End the stream with ``error``'s status (after what is queued); a bug ends it
        ``INTERNAL`` (logged with its cause by the transport's error table)."""
        if isinstance(error, PlannerError):
            ending = error
        else:
            ending = Internal("internal error", reason="INTERNAL")
            ending.__cause__ = error
        self.queue.end(ending)

    def _open_timed_out(self) -> None:
        if self.session is None:
            self.queue.end(
                FailedPrecondition(
                    "no open within the time allowed; the stream is closed",
                    reason="OPEN_TIMEOUT",
                )
            )

    # ----------------------------------------------------------------- reading

    async def read(self, commands: AsyncIterator[Command]) -> None:
        """The reader task: handle each client command in order, then the half-close.
        Never raises but its own cancellation: any failure ends the stream with a
        status and an ``ErrorInfo``."""
        try:
            await self._read(commands)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self.fail(error)

    async def _read(self, commands: AsyncIterator[Command]) -> None:
        try:
            async for command in commands:
                if self._caller.expired(self._service.clock.now().timestamp()):
                    self.queue.end(
                        Unauthenticated(
                            "the token has expired; reopen with a fresh token",
                            reason="TOKEN_EXPIRED",
                        )
                    )
                    return
                try:
                    await self._handle(command)
                except Exception as error:
                    # StoreUnavailable and bugs too: the reply says so; the stream stays.
                    self._reply_error(error, command.request_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            # Usually the client went away mid-read and the call is over anyway; if not,
            # the stream must not stay open with nobody reading.
            log.debug("chat stream reader ended", exc_info=True)
            self.queue.end(
                Unavailable(
                    "reading the stream's messages failed; reopen the stream",
                    reason="REQUEST_STREAM_FAILED",
                )
            )
            return
        await self._half_closed()

    async def _half_closed(self) -> None:
        self.half_closed = True
        if self.session is None or not self.waiting_turn or self.waiting_turn == self._ended_turn:
            # Nothing to wait for, or its end was sent already: no read of the turn.
            self.queue.end(None)
            return
        try:
            turn = await self._service.store.get_turn(self.waiting_turn)
        except StoreUnavailable as error:
            # Whether the turn ended is unknown: say so, and the client reopens.
            self.queue.end(error)
            return
        if turn is not None and turn.end_reason is not None:
            # Ended, but perhaps on another replica whose signal has not come here yet
            # (a resend answered by the replica that had stored it): deliver the end from
            # the store first, so a half-closed stream never ends without it.
            try:
                await self._service.hub.replay(self.queue, self.queue.last_sequence)
            except StoreUnavailable as error:
                self.queue.end(error)
                return
        if turn is None or turn.end_reason is not None:
            self.queue.end(None)

    async def _handle(self, command: Command) -> None:
        if isinstance(command, Open):
            await self._open(command)
        elif isinstance(command, Send):
            await self._send(command)
        elif isinstance(command, Cancel):
            self._require_open()
            task = asyncio.get_running_loop().create_task(self._cancel(command))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif isinstance(command, Refused):
            log.info("chat: refused a client message: %s", command.error.reason)
            self._reply_error(command.error, command.request_id)
        else:
            assert_never(command)

    def _reply_error(self, error: Exception, request_id: str) -> None:
        session_id = self.session.session_id if self.session else ""
        self.queue.put_reply(ErrorReply(error, request_id, session_id))

    def _require_open(self) -> Session:
        if self.session is None:
            raise FailedPrecondition("send open first", reason="NOT_OPEN")
        return self.session

    async def _open(self, command: Open) -> None:
        if self.session is not None:
            raise FailedPrecondition("this stream already has a session", reason="ALREADY_OPEN")
        check_request_id(command.request_id, required=False)
        if command.after_sequence < 0:
            raise InvalidArgument("after_sequence must not be negative", reason="INVALID_SEQUENCE")
        service = self._service
        # Both paths check the human's access to the project before anything is held.
        if command.session_id:
            session = await service.rules.owned_session(self._caller, command.session_id)
            if command.project_id and command.project_id != session.project_id:
                raise InvalidArgument(
                    "project_id names another project than the session's; send one or the other",
                    reason="PROJECT_MISMATCH",
                )
        else:
            session = await service.rules.create_session(
                self._caller,
                request_id=command.request_id or new_id("chat"),
                project_id=command.project_id,
                title=command.title,
            )
        if command.after_sequence > session.last_sequence:
            raise OutOfRange(
                f"after_sequence {command.after_sequence} is beyond the last sequence "
                f"{session.last_sequence}",
                reason="SEQUENCE_OUT_OF_RANGE",
                metadata={"last_sequence": str(session.last_sequence)},
            )
        replay = session.last_sequence - command.after_sequence
        if replay > service.limits.max_replay_events:
            raise FailedPrecondition(
                f"{replay} events to replay; at most {service.limits.max_replay_events}: "
                "page with ListMessages, then open with a recent after_sequence",
                reason="REPLAY_TOO_LARGE",
                metadata={"last_sequence": str(session.last_sequence)},
            )
        if not await self._take_slot():
            return
        self.session = session
        self._open_timer.cancel()
        # The reply first, then the replay, then live events: no await between binding
        # and the reply, so no live event can overtake it.
        self.queue.put_reply(SessionOpened(session, command.request_id))
        service.hub.bind(self.queue, session.session_id, command.after_sequence)
        await service.hub.replay(self.queue, session.last_sequence)

    async def _take_slot(self) -> bool:
        """Admit the stream against the per-human limit; False (the stream ended with
        ``TOO_MANY_STREAMS`` or ``DATABASE_UNAVAILABLE``) when refused. A stream closed
        while its slot is being taken leaves no row behind (decision 0182)."""
        service = self._service
        if service.streams is None:
            if service.hub.stream_count(self._caller.subject) >= service.limits.streams_per_human:
                self.queue.end(
                    ResourceExhausted(
                        f"at most {service.limits.streams_per_human} open Chat streams per "
                        "human; close one first",
                        reason="TOO_MANY_STREAMS",
                        retry_after_s=1.0,
                    )
                )
                return False
            return True
        self._slot = slot = service.streams.open(self._caller.subject)
        if self._closed:
            slot.release()
            return False
        try:
            await slot.admitted()
        except PlannerError as error:
            self.queue.end(error)
            return False
        return True

    async def _send(self, command: Send) -> None:
        session = self._require_open()
        service = self._service
        # The session was found owned by this caller at open, and its owner never
        # changes; the project access is re-checked (cached), and a session deleted
        # since is refused by the store when the message is stored (SESSION_NOT_FOUND).
        await service.rules.recheck_project(self._caller, session)
        request = _send_request(
            session, self._caller, command.text, command.request_id, command.on_busy
        )
        # Before the call: the live message_accepted is published before it returns.
        if command.request_id:
            self._sending.add(command.request_id)
        try:
            accepted = await service.turns.send_message(request)
        except BaseException:
            self._sending.discard(command.request_id)
            raise
        self.waiting_turn = accepted.turn.turn_id
        if accepted.duplicate:
            # A duplicate stores nothing: this stream alone hears the original again.
            self._sending.discard(command.request_id)
            self.queue.put_reply(AcceptedAgain(accepted.message_accepted, command.request_id))

    async def _cancel(self, command: Cancel) -> None:
        session = self._require_open()
        try:
            check_request_id(command.request_id, required=False)
            rules = self._service.rules
            if command.turn_id:
                # The human's access to the project is re-checked on every action.
                await rules.recheck_project(self._caller, session)
            else:
                # "The running turn": the session read at open predates it, so read it
                # now (which re-checks the project too).
                session = await rules.owned_session(self._caller, session.session_id)
            await self._service.turns.cancel(session, command.turn_id)
        except Exception as error:
            self._reply_error(error, command.request_id)


def _send_request(
    session: Session,
    caller: Caller,
    text: str,
    request_id: str,
    on_busy: OnBusy = OnBusy.REJECT,
) -> SendRequest:
    if caller.is_service:
        raise HumanRequired("sending needs the session owner's token")
    return SendRequest(
        session=session,
        human_id=caller.subject,
        organization_id=caller.organization_id,
        token=caller.token,
        text=text,
        request_id=request_id,
        on_busy=on_busy,
    )
