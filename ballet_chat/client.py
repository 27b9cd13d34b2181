"""``ballet-planner chat``: the terminal client of the ``Chat`` RPC (README.md and
docs/decisions/0051-chat-client.md, 0165-chat-client.md).

One Chat stream carries one session (docs/spec/api-and-streams.md). ``run_chat`` either

- sends one message (``--message``) in a new session of ``--project`` (or in
  ``--session``), prints the turn as it streams and returns 0 when the turn ended
  ``COMPLETED`` or ``MAX_ROUNDS``, 1 otherwise (with the reason, on stderr alone); or
- runs interactively (``ballet_chat.interactive``): every line typed is a message or a
  command (``/cancel``, ``/new``, ``/sessions``, ``/open ID``, ``/help``, ``/quit``),
  with line editing and history on a terminal (``ballet_chat.input``); a new session is
  created with the first message (its text is the title), ``--session`` resumes one.
  When stdin is not a terminal, each line waits until the previous turn has ended, and
  at the end of input the chat waits for the running turn and exits as ``--message``.

What is shown is ``ballet_chat.render``'s; with ``--json`` each ``ChatResponse`` is one
line of protobuf JSON instead. Without a human at a terminal (``--message``, piped
input), a refused message and a turn that did not end ``COMPLETED``/``MAX_ROUNDS`` are
reported once, on stderr, and stdout keeps the transcript.

The client knows its own messages by the ``request_id`` it sent, never by their text:
the planner echoes the id on its replies and on the ``message_accepted`` of the stream
that sent the message, so no read per message is needed; ``GetTurn`` is asked only about
an acceptance without one that arrives while a message of ours waits
(docs/decisions/0166-chat-without-a-terminal.md,
docs/decisions/0273-own-messages-by-request-id.md).

The stream is reopened with ``after_sequence`` (so nothing is missed or repeated) when
the planner ends it with ``SLOW_CONSUMER``, when a sequence gap shows an event was
missed, and, when the token was minted here (``--user``), on ``TOKEN_EXPIRED`` with a
fresh token. Failures to connect, authenticate or find the project raise ``ChatError``
with a message that says what to do.
"""

from __future__ import annotations

import contextlib
import enum
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import grpc
from ballet.planner.v1 import (
    chat_pb2,
    planner_service_pb2,
    planner_service_pb2_grpc,
    resources_pb2,
)
from google.protobuf import json_format
from google.rpc import status_pb2

from ballet_chat.input import LineSource, utf8_text
from ballet_chat.render import (
    DEPENDENCY_UNAVAILABLE,
    Renderer,
    TextStitcher,
    describe_status,
    describe_turn_end,
    ended_ok,
    error_of,
    short,
    status_text,
    summarize_result,
    terminal_safe,
)

__all__ = [
    "ChatClient",
    "ChatError",
    "ChatOptions",
    "LineSource",
    "Renderer",
    "Sent",
    "TextStitcher",
    "describe_turn_end",
    "short",
    "summarize_result",
]

#: Messages shown when a session is resumed (``--session`` or ``/open``).
RESUME_MESSAGES = 10
TITLE_CHARS = 80


def from_a_question(
    messages: Sequence[resources_pb2.Message],
) -> list[resources_pb2.Message]:
    """The latest messages of a resumed session as shown: from the first human message
    among them, so the view starts with a question rather than in the middle of a turn
    (a tool call without the message it answers); all of them when none is a human's."""
    for index, message in enumerate(messages):
        if message.kind == resources_pb2.MESSAGE_KIND_HUMAN:
            return list(messages[index:])
    return list(messages)


class ChatError(Exception):
    """The chat cannot go on; ``str(error)`` is the message for the human."""


@dataclass(frozen=True)
class ChatOptions:
    """What ``run_chat`` needs.

    - ``address``: the planner's ``host:port``; ``token``: the bearer token (a JWT).
    - ``project_id``: the project of a new session; ``session_id``: resume this one.
    - ``message``: send this one message and exit; None: interactive.
    - ``as_json``: print each ``ChatResponse`` as one line of protobuf JSON.
    - ``mint``: makes a fresh token (dev tokens from ``--user``), used to reopen the
      stream after ``TOKEN_EXPIRED``; None: that ends the chat.
    """

    address: str
    token: str
    project_id: str = "demo"
    session_id: str = ""
    message: str | None = None
    as_json: bool = False
    mint: Callable[[], str] | None = None


# --------------------------------------------------------------------------- the client


class End(enum.Enum):
    CLOSED = "closed"  # the planner ended the stream normally
    REOPEN = "reopen"  # reopen with after_sequence


@dataclass
class Sent:
    """A message this client sent and what became of it.

    ``text`` is what was sent (valid UTF-8); ``turn_id`` is set once the planner accepted
    it, ``ended`` once that turn ended, ``refused`` (``CODE REASON: message``) when the
    planner refused it.
    """

    request_id: str
    text: str
    turn_id: str = ""
    ended: chat_pb2.TurnEnded | None = None
    refused: str = ""
    #: What the planner does with it while a turn runs (0: refuse it).
    on_busy: resources_pb2.OnBusy.ValueType = resources_pb2.ON_BUSY_REJECT

    @property
    def done(self) -> bool:
        """Refused, or its turn ended."""
        return bool(self.refused) or self.ended is not None

    @property
    def ok(self) -> bool:
        """Accepted, and its turn ended ``COMPLETED`` or ``MAX_ROUNDS``."""
        return self.ended is not None and ended_ok(self.ended)


@dataclass
class ChatClient:
    """One terminal chat: a channel, the current Chat stream and session, the output."""

    options: ChatOptions
    out: TextIO
    err: TextIO
    channel: Any = None
    token: str = ""
    session: resources_pb2.Session | None = None
    last_sequence: int = 0
    running_turn: str = ""
    #: Messages sent and not yet accepted or refused, by request id.
    pending: dict[str, Sent] = field(default_factory=dict)
    #: Messages of this client the planner accepted on this session, by turn id.
    own_turns: dict[str, Sent] = field(default_factory=dict)
    #: Turns of this client's messages that wait behind the running turn (queued), in
    #: the order they were queued (docs/decisions/0300-queued-turns.md).
    queued: list[str] = field(default_factory=list)
    #: How many of this client's messages were refused or ended their turn otherwise
    #: than COMPLETED or MAX_ROUNDS, and how many of its commands failed (a usage error,
    #: an /open that found no session).
    failed: int = 0
    #: No human watches a terminal (``--message``, piped input): errors go to stderr
    #: once, prefixed like the CLI's, instead of into the transcript.
    batch: bool = False
    #: ``/cancel`` (or Ctrl-C) came while a message was being accepted: cancel the turn
    #: as soon as it starts.
    cancel_requested: bool = False
    #: How each turn seen on this session ended, by turn id.
    ended: dict[str, chat_pb2.TurnEnded] = field(default_factory=dict)
    #: The latest messages of a resumed session, until they are shown.
    recent: list[resources_pb2.Message] = field(default_factory=list)
    #: The resumed session has messages before ``recent`` (not shown: ``/history``).
    earlier_hidden: bool = False
    #: The session this client created for its first message, while none of its messages
    #: was accepted or queued there; ``refused_only`` once the planner refused one there.
    #: Such a session holds nothing: it is deleted when the chat leaves it (decision 0228).
    created: str = ""
    refused_only: bool = False
    #: Called when no turn runs and no message is pending any more (the prompt).
    on_idle: Callable[[], None] | None = None
    renderer: Renderer = field(init=False)
    _call: Any = None
    _stub: Any = None

    def __post_init__(self) -> None:
        self.renderer = Renderer(self.out)
        self.token = self.options.token

    # -- plumbing -------------------------------------------------------------

    @property
    def stub(self) -> Any:
        """The PlannerService stub on the channel (an async stub)."""
        if self._stub is None:
            self._stub = planner_service_pb2_grpc.PlannerServiceStub(self.channel)
        return self._stub

    @property
    def busy(self) -> bool:
        """True while a turn runs, a message sent waits for its answer, or a message of
        this client waits queued."""
        return bool(self.running_turn or self.pending or self.queued)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    def _fail(self, error: grpc.aio.AioRpcError, doing: str) -> ChatError:
        code, reason, message = error_of(error)
        address = self.options.address
        if reason == DEPENDENCY_UNAVAILABLE:
            # The planner answered: it is one of its own dependencies that is missing.
            return ChatError(f"{doing}: {describe_status(code, reason, message)}")
        if code == "UNAVAILABLE" and self.session is not None:
            # The planner's own words speak to API clients (how to reopen the stream):
            # the human gets what to do with this command.
            why = (
                "the planner stopped"
                if reason == "SHUTTING_DOWN"
                else (f"lost the connection to the planner at {address}")
            )
            return ChatError(f"{why}; {self.continue_hint()}")
        if code == "UNAVAILABLE":
            return ChatError(
                f"cannot reach the planner at {address} ({message}); is `ballet-planner dev` "
                "(or serve) running there? (--address)"
            )
        if code == "UNIMPLEMENTED" and not reason:
            # gRPC's own answer for a method the server does not have: another service.
            return ChatError(
                f"no planner answers at {address}: the server there has no Chat method "
                "(another service on that port?); --address names the planner's"
            )
        if code == "UNAUTHENTICATED":
            hint = (
                "mint a fresh one, from the data directory the planner uses: "
                "`ballet-planner token --user NAME --data-dir DIR`, or pass --user and "
                "--data-dir here"
            )
            return ChatError(
                f"the planner refused the token ({describe_status(code, reason, message)}); " + hint
            )
        return ChatError(f"{doing}: {describe_status(code, reason, message)}")

    def continue_hint(self) -> str:
        """How to go on with this session later: the same command with ``--session``."""
        if self.session is None:
            return "start the chat again once the planner is back"
        return (
            "once it is back, rerun the same command with --session "
            f"{self.session.session_id} to continue"
        )

    def _refusal(self, status: status_pb2.Status, doing: str, session_id: str) -> ChatError:
        code, reason, message = status_text(status)
        if code == "NOT_FOUND" and session_id:
            return ChatError(
                f"session {session_id!r} not found (or it is not yours): "
                f"{describe_status(code, reason, message)}"
            )
        if code == "NOT_FOUND":
            return ChatError(
                f"project {self.options.project_id!r} not found, or you may not read it "
                f"({describe_status(code, reason, message)}); --project names it"
            )
        return ChatError(f"{doing}: {describe_status(code, reason, message)}")

    async def _close_stream(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            # A client disconnect is not a cancel (docs/spec/api-and-streams.md): a running turn
            # goes on.
            call.cancel()

    async def open(self, *, session_id: str = "", title: str = "", after: int = 0) -> None:
        """Open a Chat stream on ``session_id``, or on a new session of the project (with
        ``title``); the events after sequence ``after`` follow through ``next_event``.

        Raises ``ChatError``: unreachable, token refused, no such project or session.
        """
        await self._close_stream()
        if session_id != self.created:
            await self._drop_unused()
        request_id = uuid.uuid4().hex
        action = chat_pb2.OpenAction(after_sequence=after)
        if session_id:
            action.session_id = session_id
            doing = f"opening session {session_id}"
        else:
            action.project_id = self.options.project_id
            action.title = utf8_text(title)
            doing = f"creating a session in project {self.options.project_id}"
        call = self.stub.Chat(metadata=self._metadata())
        self._call = call
        try:
            try:
                await call.write(chat_pb2.ChatRequest(request_id=request_id, open=action))
                while True:
                    response = await call.read()
                    if response is grpc.aio.EOF:
                        raise ChatError(f"{doing}: the planner ended the stream")
                    self._emit_json(response)
                    kind = response.WhichOneof("event")
                    if kind == "session_opened":
                        self.session = response.session_opened.session
                        if not session_id:
                            self.created, self.refused_only = self.session.session_id, False
                        elif session_id != self.created:
                            self.created, self.refused_only = "", False
                        self.last_sequence = after
                        self.running_turn = self.session.running_turn_id
                        self.pending.clear()
                        self.cancel_requested = False
                        return
                    if kind == "error" and response.request_id == request_id:
                        raise self._refusal(response.error, doing, session_id)
            except grpc.aio.AioRpcError as error:
                raise self._fail(error, doing) from None
        except BaseException:
            await self._close_stream()
            raise

    async def next_event(self) -> chat_pb2.ChatResponse | End:
        """The next response of the current stream (shown and tracked), ``End.REOPEN``
        when the stream must be reopened, or ``End.CLOSED``. Raises ``ChatError``."""
        call = self._call
        assert call is not None
        try:
            response = await call.read()
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED and self._call is not call:
                return End.CLOSED  # we closed it ourselves (/new, /open)
            _, reason, _ = error_of(error)
            if reason == "SLOW_CONSUMER":
                return End.REOPEN
            if reason == "TOKEN_EXPIRED" and self.options.mint is not None:
                self.token = self.options.mint()
                return End.REOPEN
            raise self._fail(error, "the chat stream ended") from None
        if response is grpc.aio.EOF:
            return End.CLOSED
        assert isinstance(response, chat_pb2.ChatResponse)
        if response.WhichOneof("event") == "heartbeat":
            # Keeps proxies from cutting an idle stream; nothing to show or track.
            return await self.next_event()
        if response.sequence > self.last_sequence + 1:
            # An event was missed (docs/spec/api-and-streams.md: a stream that sees a gap reopens).
            return End.REOPEN
        claimed = ""
        if response.WhichOneof("event") in ("message_accepted", "message_queued"):
            claimed = await self._sender_of(response)
        self.track(response, sender=claimed)
        if self.cancel_requested and self.running_turn:
            self.cancel_requested = False
            await self.cancel()
        return response

    async def reopen(self) -> None:
        """Reopen the current session after the last sequence seen, and send again the
        messages not accepted yet, with their request ids: the planner stores each once
        and answers a duplicate with its ``message_accepted`` (AIP-155)."""
        assert self.session is not None
        pending = dict(self.pending)
        await self.open(session_id=self.session.session_id, after=self.last_sequence)
        self.pending.update(pending)
        for request_id, sent in pending.items():
            await self._write_message(request_id, sent.text, sent.on_busy)

    async def _sender_of(self, response: chat_pb2.ChatResponse) -> str:
        """The request id of this client's message that ``response`` (a
        ``message_accepted``) accepts, or ``""`` when it is another client's.

        The planner sets ``request_id`` on the ``message_accepted`` of the stream that
        sent the message (and on a duplicate's reply), never on the other streams of the
        session, so a chat reads nothing per message. Only an acceptance without one that
        arrives while a message of ours waits (another client's message that won the
        race, a replay after a reopen, a planner of an earlier release) is asked about
        with ``GetTurn``; should that read fail, the oldest message waiting claims the
        turn (one turn runs per session: a message accepted while ours was in flight is
        ours unless another client's won the race, and ours is then refused
        ``TURN_IN_PROGRESS``, which this client reports).
        """
        if response.request_id or not self.pending or response.turn_id in self.own_turns:
            return response.request_id
        assert self.session is not None
        try:
            got = await self.stub.GetTurn(
                planner_service_pb2.GetTurnRequest(
                    session_id=self.session.session_id, turn_id=response.turn_id
                ),
                metadata=self._metadata(),
                timeout=10,
            )
        except grpc.aio.AioRpcError:
            return next(iter(self.pending))
        request_id: str = got.turn.request_id
        return request_id

    def track(self, response: chat_pb2.ChatResponse, *, sender: str = "") -> None:
        """Follow the session's state and show ``response``. ``sender``: the request id
        of this client's message a ``message_accepted`` accepts (see ``_sender_of``);
        ``""`` when it is another client's, or when the response echoes the id itself."""
        if response.sequence > 0:
            self.last_sequence = max(self.last_sequence, response.sequence)
        kind = response.WhichOneof("event")
        was_busy = self.busy
        report = ""  # said once on stderr instead of the transcript (batch mode)
        #: A queued message of ours that starts now is shown, where it is answered.
        echo_mine = False
        if (
            kind in ("message_queued", "message_accepted")
            and (sender or response.request_id) in self.pending
        ):
            # A message of ours is stored: the session is in use.
            self.created, self.refused_only = "", False
        if kind == "message_queued":
            sent = self.pending.pop(sender or response.request_id, None)
            if sent is not None and not sent.turn_id:
                sent.turn_id = response.turn_id
                self.own_turns[response.turn_id] = sent
                if response.turn_id not in self.ended:
                    self.queued.append(response.turn_id)
        elif kind == "message_accepted" and response.turn_id in self.queued:
            # A queued message of ours starts its turn: shown now, where it is answered.
            self.queued.remove(response.turn_id)
            self.running_turn = response.turn_id
            echo_mine = True
        elif kind == "message_accepted":
            if response.turn_id not in self.ended:
                # A duplicate's reply may name a turn that has ended already.
                self.running_turn = response.turn_id
            sent = self.pending.pop(sender or response.request_id, None)
            if sent is not None and not sent.turn_id:
                sent.turn_id = response.turn_id
                self.own_turns[response.turn_id] = sent
                if response.turn_id in self.ended:  # a duplicate's reply, after a reopen
                    report = self._finished(sent, self.ended[response.turn_id])
        elif kind == "turn_started":
            if response.turn_id not in self.ended:
                self.running_turn = response.turn_id
        elif kind == "turn_ended":
            self.ended[response.turn_id] = response.turn_ended
            if self.running_turn == response.turn_id:
                self.running_turn = ""
            if response.turn_id in self.queued:  # cancelled before it ran
                self.queued.remove(response.turn_id)
            sent = self.own_turns.get(response.turn_id)
            if sent is not None and sent.ended is None:
                report = self._finished(sent, response.turn_ended)
        elif kind == "error":
            error = describe_status(*status_text(response.error))
            sent = self.pending.pop(response.request_id, None)
            if sent is not None:
                sent.refused = error
                self.failed += 1
                if self.created and self.session and self.session.session_id == self.created:
                    self.refused_only = True
            report = ("message refused: " if sent is not None else "error: ") + error
        if not self._emit_json(response):
            if self.batch and report:
                self.renderer.end_line()
            else:
                mine = response.turn_id in self.own_turns and not echo_mine
                self.renderer.render(response, mine=mine)
        if self.batch and report:
            print(f"ballet-planner chat: {terminal_safe(report)}", file=self.err, flush=True)
        if not self.busy:
            self.cancel_requested = False
        if was_busy and not self.busy and self.on_idle is not None:
            self.on_idle()

    def _finished(self, sent: Sent, ended: chat_pb2.TurnEnded) -> str:
        """Record how the turn of ``sent`` ended; what to report when it failed."""
        sent.ended = ended
        if ended_ok(ended):
            return ""
        self.failed += 1
        return "the turn ended " + describe_turn_end(ended)

    def _emit_json(self, response: chat_pb2.ChatResponse) -> bool:
        if self.options.as_json:
            self.out.write(json_format.MessageToJson(response, indent=None) + "\n")
            self.out.flush()
        return self.options.as_json

    def note(self, text: str) -> None:
        """A line from the client itself (not the planner): stdout, or stderr in JSON
        mode so that stdout stays one JSON object per line."""
        if self.options.as_json:
            print(terminal_safe(text), file=self.err, flush=True)
        else:
            self.renderer.aside(text)

    @property
    def holds_nothing(self) -> bool:
        """The open session is the one this client created, the planner refused every
        message sent there and none is pending: it stores nothing, and its title is a
        refused message's."""
        session = self.session
        return (
            session is not None
            and session.session_id == self.created
            and self.refused_only
            and not self.pending
        )

    async def send(
        self, text: str, on_busy: resources_pb2.OnBusy.ValueType = resources_pb2.ON_BUSY_REJECT
    ) -> Sent:
        """Send ``text`` as a message of the open session (made valid UTF-8 first, see
        ``utf8_text``); ``on_busy`` (an ``OnBusy`` value) says what the planner does
        with it while a turn runs. Returns what the client follows of it."""
        assert self._call is not None and self.session is not None
        sent = Sent(request_id=uuid.uuid4().hex, text=utf8_text(text), on_busy=on_busy)
        self.pending[sent.request_id] = sent
        await self._write_message(sent.request_id, sent.text, on_busy)
        return sent

    async def _write_message(
        self,
        request_id: str,
        text: str,
        on_busy: resources_pb2.OnBusy.ValueType = resources_pb2.ON_BUSY_REJECT,
    ) -> None:
        assert self._call is not None
        await self._call.write(
            chat_pb2.ChatRequest(
                request_id=request_id,
                send_message=chat_pb2.SendMessageAction(text=text, on_busy=on_busy),
            )
        )

    async def cancel(self) -> bool:
        """Ask to cancel the running turn; False when none runs (yet): see
        ``request_cancel`` for a message still being accepted."""
        if not self.running_turn or self._call is None:
            return False
        await self._call.write(
            chat_pb2.ChatRequest(
                request_id=uuid.uuid4().hex,
                cancel_turn=chat_pb2.CancelTurnAction(turn_id=self.running_turn),
            )
        )
        return True

    async def cancel_acknowledged(self) -> None:
        """Cancel the running turn with the unary ``CancelTurn``, which answers once the
        planner has the cancel (a cancel written on the stream may not be read before the
        stream closes); errors are ignored: the turn may have ended, or the planner be
        gone. Nothing when no turn is known to run."""
        if not self.running_turn or self.session is None:
            return
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.stub.CancelTurn(
                planner_service_pb2.CancelTurnRequest(
                    request_id=uuid.uuid4().hex,
                    session_id=self.session.session_id,
                    turn_id=self.running_turn,
                ),
                metadata=self._metadata(),
            )

    async def request_cancel(self) -> str:
        """Cancel the running turn now (``"now"``), or, while a message sent is being
        accepted, as soon as its turn starts (``"later"``); ``""`` when nothing runs."""
        if await self.cancel():
            return "now"
        if self.pending:
            self.cancel_requested = True
            return "later"
        return ""

    async def check(self) -> None:
        """Ask the planner for the project's newest session, to learn early that it is
        reachable and accepts the token. Raises ``ChatError`` saying what to do."""
        try:
            await self.stub.ListSessions(
                planner_service_pb2.ListSessionsRequest(
                    project_id=self.options.project_id, page_size=1
                ),
                metadata=self._metadata(),
                timeout=10,
            )
        except grpc.aio.AioRpcError as error:
            raise self._fail(error, f"listing the sessions of {self.options.project_id}") from None

    async def leave(self) -> None:
        """Close the current session's stream (a running turn goes on) and forget it:
        the next message starts a new session."""
        await self._close_stream()
        self.session = None
        self.running_turn = ""
        self.pending.clear()
        self.own_turns.clear()
        self.queued.clear()
        self.cancel_requested = False
        self.last_sequence = 0

    async def close(self) -> None:
        """Close the stream and the channel; first delete the session this client created
        if the planner refused its message there and stored none (``created``)."""
        await self._close_stream()
        if self.channel is not None:
            await self._drop_unused()
            await self.channel.close()

    async def _drop_unused(self) -> None:
        """Delete the session this client created when the planner refused its message
        there and stored none of its messages (``created``), and it still holds no
        message (another client could have written to it meanwhile); a failure leaves
        it, as before."""
        session_id = self.created
        if not (session_id and self.refused_only and not self.pending):
            return
        self.created, self.refused_only = "", False
        try:
            listed = await self.stub.ListMessages(
                planner_service_pb2.ListMessagesRequest(session_id=session_id, page_size=1),
                metadata=self._metadata(),
                timeout=5,
            )
            if listed.messages:
                return
            await self.stub.DeleteSession(
                planner_service_pb2.DeleteSessionRequest(session_id=session_id),
                metadata=self._metadata(),
                timeout=5,
            )
        except grpc.aio.AioRpcError:
            return
        print(
            f"ballet-planner chat: session {session_id} deleted: its message was refused, "
            "so it held nothing",
            file=self.err,
            flush=True,
        )

    # -- session helpers --------------------------------------------------------

    async def resume(self, session_id: str) -> None:
        """Open an existing session after its last event; its latest messages are kept in
        ``recent`` (interactive mode) for the caller to show."""
        try:
            got = await self.stub.GetSession(
                planner_service_pb2.GetSessionRequest(session_id=session_id),
                metadata=self._metadata(),
                timeout=10,
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                raise ChatError(f"session {session_id!r} not found (or it is not yours)") from None
            raise self._fail(error, f"reading session {session_id}") from None
        last = got.session.last_sequence
        if not self.options.as_json and self.options.message is None:
            self.recent = await self._history(session_id, last)
        await self.open(session_id=session_id, after=last)

    async def _history(self, session_id: str, last: int) -> list[resources_pb2.Message]:
        # Sequences count events, not messages: a window of a few events per message
        # shows about the last RESUME_MESSAGES messages in one bounded page.
        after = max(0, last - 4 * RESUME_MESSAGES)
        listed = await self.stub.ListMessages(
            planner_service_pb2.ListMessagesRequest(
                session_id=session_id, after_sequence=after, page_size=4 * RESUME_MESSAGES
            ),
            metadata=self._metadata(),
            timeout=10,
        )
        messages = list(listed.messages)
        # Messages before the window (events 1..after hold the first ones), or cut from
        # it, are not shown.
        self.earlier_hidden = after > 0 or len(messages) > RESUME_MESSAGES
        return from_a_question(messages[-RESUME_MESSAGES:])

    async def history(self) -> list[resources_pb2.Message]:
        """Every message of the open session, oldest first (``ListMessages`` page by
        page). Raises ``ChatError``."""
        assert self.session is not None
        messages: list[resources_pb2.Message] = []
        token = ""
        while True:
            try:
                page = await self.stub.ListMessages(
                    planner_service_pb2.ListMessagesRequest(
                        session_id=self.session.session_id, page_size=100, page_token=token
                    ),
                    metadata=self._metadata(),
                    timeout=10,
                )
            except grpc.aio.AioRpcError as error:
                raise self._fail(error, "listing the session's messages") from None
            messages.extend(page.messages)
            token = page.next_page_token
            if not token:
                return messages


# --------------------------------------------------------------------------- modes


async def pump(client: ChatClient) -> None:
    """Read the stream until the planner closes it, reopening when needed."""
    while True:
        event = await client.next_event()
        if event is End.REOPEN:
            await client.reopen()
        elif event is End.CLOSED:
            return
