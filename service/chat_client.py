"""``ballet-planner chat``: the terminal client of the ``Chat`` RPC (SPEC section 9).

One Chat stream carries one session (SPEC section 3). ``run_chat`` opens it (a new
session of ``--project``, or ``--session``), then either

- sends one message (``--message``), prints the turn as it streams and returns 0 when
  the turn ended ``COMPLETED`` or ``MAX_ROUNDS``, 1 otherwise (with the reason); or
- runs interactively: every line typed is a message, and the commands ``/cancel`` (the
  running turn), ``/new`` (a new session), ``/sessions`` (ListSessions of the project),
  ``/open ID`` (another session), ``/help`` and ``/quit``. Input is read while a turn
  streams, so ``/cancel`` works mid-answer; Ctrl-C cancels a running turn, or quits.

Output: text deltas as they arrive, stitched by message id and character offset (a delta
already shown is skipped; the ``assistant_message`` completes what is missing); one line
per tool call (``-> name {args}``) and result (``<- name: ok, 12 items`` or
``<- name: error NOT_FOUND: ...``); one line when the turn ends. With ``--json`` each
``ChatResponse`` is one line of protobuf JSON instead.

The stream is reopened with ``after_sequence`` (so nothing is missed or repeated) when
the planner ends it with ``SLOW_CONSUMER``, when a sequence gap shows an event was
missed, and, when the token was minted here (``--user``), on ``TOKEN_EXPIRED`` with a
fresh token. Failures to connect, authenticate or find the project raise ``ChatError``
with a message that says what to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import signal
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import grpc
from ballet.planner.v1 import (
    chat_pb2,
    planner_service_pb2,
    planner_service_pb2_grpc,
    resources_pb2,
)
from google.protobuf import field_mask_pb2, json_format
from google.rpc import status_pb2

from service.transport.errors import error_info_of, status_from_trailers

#: How many characters of a tool call's arguments and of a result summary are shown.
SHORT_CHARS = 100
#: Messages shown when a session is resumed (``--session`` or ``/open``).
RESUME_MESSAGES = 10
TITLE_CHARS = 80

_ENDED_OK = (
    resources_pb2.TURN_END_REASON_COMPLETED,
    resources_pb2.TURN_END_REASON_MAX_ROUNDS,
)
_HELP = (
    "Type a message and press Enter. Commands: /cancel (the running turn), /new (a new "
    "session), /sessions (this project's sessions), /open ID (another session), /help, "
    "/quit. Ctrl-C cancels a running turn, or quits."
)


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


# --------------------------------------------------------------------------- rendering


class TextStitcher:
    """Stitches text deltas by message id and character offset (SPEC section 3).

    ``add`` returns the part of a delta not shown yet ("" for a repeat, e.g. after a
    reopen); ``finish`` returns what the full text adds to what was shown: the rest, or,
    after a gap in the offsets (text was missed), a newline and the whole text again.
    """

    def __init__(self) -> None:
        self._shown: dict[str, int] = {}
        self._gapped: set[str] = set()

    def add(self, message_id: str, offset: int, text: str) -> str:
        """The new part of the delta ``text`` that starts at character ``offset``."""
        shown = self._shown.get(message_id, 0)
        end = offset + len(text)
        if end <= shown:
            return ""
        if offset > shown:
            self._gapped.add(message_id)
            self._shown[message_id] = end
            return text
        self._shown[message_id] = end
        return text[shown - offset :]

    def finish(self, message_id: str, text: str) -> str:
        """What is left to show of the message whose full text is ``text``."""
        shown = self._shown.pop(message_id, 0)
        if message_id in self._gapped:
            self._gapped.discard(message_id)
            return "\n" + text
        return text[shown:]

    def shown(self, message_id: str) -> int:
        """Characters of ``message_id`` shown so far."""
        return self._shown.get(message_id, 0)


def short(text: str, limit: int = SHORT_CHARS) -> str:
    """``text`` on one line, cut to ``limit`` characters with "…"."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def summarize_result(content: str, is_error: bool) -> str:
    """One short phrase for a tool result (our JSON shapes, service/core/tools.py):
    ``error REASON: message``, ``ok, 12 items (of 40)``, ``ok, item X: title``, or the
    JSON cut short."""
    try:
        value = json.loads(content)
    except ValueError:
        return ("error: " if is_error else "ok: ") + short(content)
    if isinstance(value, dict):
        error = value.get("error")
        if is_error or isinstance(error, dict):
            if isinstance(error, dict):
                return short(f"error {error.get('reason', '')}: {error.get('message', '')}")
            return "error: " + short(content)
        if value.get("truncated") is True:
            return f"ok, {value.get('original_bytes', '?')} bytes (cut for the model)"
        for key, item in value.items():
            if isinstance(item, list):
                total = value.get("total_size")
                of = f" (of {total})" if isinstance(total, int) and total > len(item) else ""
                return f"ok, {len(item)} {key}{of}"
        for key, item in value.items():
            if isinstance(item, dict):
                ident = next(
                    (
                        str(item[name])
                        for name in ("item_id", "changeset_id", "entry_id", "name")
                        if item.get(name)
                    ),
                    "",
                )
                title = item.get("title") or item.get("description") or ""
                version = f" v{item['version']}" if item.get("version") else ""
                return short(f"ok, {key} {ident}{version}" + (f": {title}" if title else ""))
    return "ok: " + short(content)


def describe_status(code: str, reason: str, message: str) -> str:
    """``CODE REASON: message`` (reason left out when empty)."""
    return f"{code} {reason}: {message}" if reason else f"{code}: {message}"


def _status_text(status: status_pb2.Status) -> tuple[str, str, str]:
    info = error_info_of(status)
    code = next(
        (member.name for member in grpc.StatusCode if member.value[0] == status.code),
        str(status.code),
    )
    return code, info.reason if info else "", status.message


def _error_of(error: grpc.aio.AioRpcError) -> tuple[str, str, str]:
    status = status_from_trailers(error.trailing_metadata())
    info = error_info_of(status) if status is not None else None
    return error.code().name, info.reason if info else "", error.details() or ""


class Renderer:
    """Human-readable output of ``ChatResponse``s on ``out`` (see the module docstring)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.stitcher = TextStitcher()
        self._line_open = False
        #: The text of the messages this client sent and has not seen accepted yet, so
        #: that only other clients' messages are echoed.
        self.sent: list[str] = []

    def write(self, text: str) -> None:
        """Write ``text`` and flush (the terminal shows deltas as they come)."""
        if text:
            self.out.write(text)
            self.out.flush()
            self._line_open = not text.endswith("\n")

    def line(self, text: str) -> None:
        """Write ``text`` on a line of its own."""
        self.end_line()
        self.write(text + "\n")

    def end_line(self) -> None:
        """Start a new line if the cursor is not at the start of one."""
        if self._line_open:
            self.write("\n")

    def render(self, response: chat_pb2.ChatResponse) -> None:
        """Show one response."""
        kind = response.WhichOneof("event")
        if kind == "text_delta":
            delta = response.text_delta
            self.write(self.stitcher.add(delta.message_id, delta.offset, delta.text))
        elif kind == "assistant_message":
            message = response.assistant_message.message
            rest = self.stitcher.finish(message.message_id, message.text)
            self.write(rest)
            if message.cut:
                self.write(" [cut]")
            self.end_line()
        elif kind == "message_accepted":
            message = response.message_accepted.message
            if message.text in self.sent:
                self.sent.remove(message.text)
            elif not response.request_id:
                self.line(f"{message.human_id or 'human'}: {message.text}")
        elif kind == "tool_call_started":
            message = response.tool_call_started.message
            self.line(f"  -> {message.tool_name} {short(message.tool_arguments or '{}')}")
        elif kind == "tool_call_finished":
            message = response.tool_call_finished.message
            summary = summarize_result(message.tool_result, message.tool_error)
            self.line(f"  <- {message.tool_name}: {summary}")
        elif kind == "changeset_proposed":
            changeset = response.changeset_proposed.changeset_id
            self.line(f"  ** changeset {changeset} proposed: a human applies or rejects it")
        elif kind == "knowledge_written":
            written = response.knowledge_written
            self.line(f"  ** knowledge entry {written.entry_id} v{written.version} written")
        elif kind == "compacted":
            compacted = response.compacted
            self.line(
                f"  (earlier conversation compacted: a summary now stands for messages up to "
                f"#{compacted.up_to}; about {compacted.estimated_tokens} tokens before)"
            )
        elif kind == "turn_ended":
            self.line(describe_turn_end(response.turn_ended))
        elif kind == "error":
            self.line("error: " + describe_status(*_status_text(response.error)))

    def message(self, message: resources_pb2.Message) -> None:
        """Show a stored message (a resumed session's history)."""
        if message.kind == resources_pb2.MESSAGE_KIND_HUMAN:
            self.line(f"{message.human_id or 'human'}: {message.text}")
        elif message.kind == resources_pb2.MESSAGE_KIND_ASSISTANT:
            if message.text:
                self.line(message.text + (" [cut]" if message.cut else ""))
        elif message.kind == resources_pb2.MESSAGE_KIND_TOOL_CALL:
            self.line(f"  -> {message.tool_name} {short(message.tool_arguments or '{}')}")
        elif message.kind == resources_pb2.MESSAGE_KIND_TOOL_RESULT:
            summary = summarize_result(message.tool_result, message.tool_error)
            self.line(f"  <- {message.tool_name}: {summary}")
        elif message.kind == resources_pb2.MESSAGE_KIND_COMPACTION:
            self.line(f"  (compacted up to #{message.up_to})")


def describe_turn_end(ended: chat_pb2.TurnEnded) -> str:
    """``[COMPLETED: 1 round, 812 tokens]`` (tokens when the model reported usage), with
    the error of a failed turn."""
    reason = resources_pb2.TurnEndReason.Name(ended.reason).removeprefix("TURN_END_REASON_")
    rounds = f"{ended.rounds} round" + ("" if ended.rounds == 1 else "s")
    tokens = ended.usage.input_tokens + ended.usage.output_tokens
    text = f"[{reason}: {rounds}" + (f", {tokens} tokens" if tokens else "")
    if ended.reason == resources_pb2.TURN_END_REASON_MAX_ROUNDS:
        text += "; send a message to continue"
    if ended.error_info.reason or ended.error_message:
        text += f"; {ended.error_info.reason}: {ended.error_message}"
    return text + "]"


# --------------------------------------------------------------------------- input


class LineSource:
    """Lines typed on ``stream`` (default stdin), read by a daemon thread so that the
    event loop keeps serving the Chat stream; ``get`` returns None at end of input.

    A daemon thread, not the loop's executor: a read blocked on a terminal must not keep
    the process from exiting after ``/quit``.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stdin
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="chat-stdin", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                line = self._stream.readline()
            except (OSError, ValueError):
                line = ""
            with contextlib.suppress(RuntimeError):  # the loop closed: we are exiting
                self._loop.call_soon_threadsafe(self._queue.put_nowait, line or None)
            if not line:
                return

    async def get(self) -> str | None:
        """The next line without its newline, or None at end of input."""
        line = await self._queue.get()
        return None if line is None else line.rstrip("\r\n")


# --------------------------------------------------------------------------- the client


class _End(enum.Enum):
    CLOSED = "closed"  # the planner ended the stream normally
    REOPEN = "reopen"  # reopen with after_sequence


@dataclass
class _Turn:
    """What the client knows of the turn it waits for (one-shot mode)."""

    request_id: str
    text: str
    turn_id: str = ""
    ended: chat_pb2.TurnEnded | None = None
    refused: str = ""


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
    #: Messages sent and not yet accepted or refused: request id -> text.
    pending: dict[str, str] = field(default_factory=dict)
    untitled: bool = False
    #: How each turn seen on this session ended, by turn id.
    ended: dict[str, chat_pb2.TurnEnded] = field(default_factory=dict)
    #: The latest messages of a resumed session, until they are shown.
    recent: list[resources_pb2.Message] = field(default_factory=list)
    waiting: _Turn | None = None
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
        """True while a turn runs or a message sent waits for its answer."""
        return bool(self.running_turn or self.pending)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    def _fail(self, error: grpc.aio.AioRpcError, doing: str) -> ChatError:
        code, reason, message = _error_of(error)
        address = self.options.address
        if code == "UNAVAILABLE" and self.session is not None:
            return ChatError(f"lost the connection to the planner at {address} ({message})")
        if code == "UNAVAILABLE":
            return ChatError(
                f"cannot reach the planner at {address} ({message}); is `ballet-planner dev` "
                "(or serve) running there? (--address)"
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

    def _refusal(self, status: status_pb2.Status, doing: str, session_id: str) -> ChatError:
        code, reason, message = _status_text(status)
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
            # A client disconnect is not a cancel (SPEC section 3): a running turn goes on.
            call.cancel()

    async def open(self, *, session_id: str = "", title: str = "", after: int = 0) -> None:
        """Open a Chat stream on ``session_id``, or on a new session of the project (with
        ``title``); the events after sequence ``after`` follow through ``next_event``.

        Raises ``ChatError``: unreachable, token refused, no such project or session.
        """
        await self._close_stream()
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
                        self.last_sequence = after
                        self.running_turn = self.session.running_turn_id
                        self.pending.clear()
                        return
                    if kind == "error" and response.request_id == request_id:
                        raise self._refusal(response.error, doing, session_id)
            except grpc.aio.AioRpcError as error:
                raise self._fail(error, doing) from None
        except BaseException:
            await self._close_stream()
            raise

    async def next_event(self) -> chat_pb2.ChatResponse | _End:
        """The next response of the current stream (shown and tracked), ``_End.REOPEN``
        when the stream must be reopened, or ``_End.CLOSED``. Raises ``ChatError``."""
        call = self._call
        assert call is not None
        try:
            response: chat_pb2.ChatResponse = await call.read()
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED and self._call is not call:
                return _End.CLOSED  # we closed it ourselves (/new, /open)
            _, reason, _ = _error_of(error)
            if reason == "SLOW_CONSUMER":
                return _End.REOPEN
            if reason == "TOKEN_EXPIRED" and self.options.mint is not None:
                self.token = self.options.mint()
                return _End.REOPEN
            raise self._fail(error, "the chat stream ended") from None
        if response is grpc.aio.EOF:
            return _End.CLOSED
        if response.sequence > self.last_sequence + 1:
            # An event was missed (SPEC section 3: a stream that sees a gap reopens).
            return _End.REOPEN
        self.track(response)
        return response

    async def reopen(self) -> None:
        """Reopen the current session after the last sequence seen, and send again the
        messages not accepted yet, with their request ids: the planner stores each once
        and answers a duplicate with its ``message_accepted`` (AIP-155)."""
        assert self.session is not None
        pending = dict(self.pending)
        await self.open(session_id=self.session.session_id, after=self.last_sequence)
        self.pending.update(pending)
        for request_id, text in pending.items():
            await self._write_message(request_id, text)

    def track(self, response: chat_pb2.ChatResponse) -> None:
        """Follow the session's state and show ``response``."""
        if response.sequence > 0:
            self.last_sequence = max(self.last_sequence, response.sequence)
        kind = response.WhichOneof("event")
        waiting = self.waiting
        was_busy = self.busy
        if kind == "message_accepted":
            message = response.message_accepted.message
            if response.turn_id not in self.ended:
                # A duplicate's reply may name a turn that has ended already.
                self.running_turn = response.turn_id
            for request_id, text in list(self.pending.items()):
                if request_id == response.request_id or text == message.text:
                    del self.pending[request_id]
                    break
            if (
                waiting is not None
                and not waiting.turn_id
                and (response.request_id == waiting.request_id or message.text == waiting.text)
            ):
                waiting.turn_id = response.turn_id
                waiting.ended = self.ended.get(response.turn_id)
        elif kind == "turn_started":
            if response.turn_id not in self.ended:
                self.running_turn = response.turn_id
        elif kind == "turn_ended":
            self.ended[response.turn_id] = response.turn_ended
            if self.running_turn == response.turn_id:
                self.running_turn = ""
            if waiting is not None and waiting.turn_id == response.turn_id:
                waiting.ended = response.turn_ended
        elif kind == "error":
            self.pending.pop(response.request_id, None)
            if waiting is not None and response.request_id == waiting.request_id:
                waiting.refused = describe_status(*_status_text(response.error))
        if not self._emit_json(response):
            self.renderer.render(response)
        if was_busy and not self.busy and self.on_idle is not None:
            self.on_idle()

    def _emit_json(self, response: chat_pb2.ChatResponse) -> bool:
        if self.options.as_json:
            self.out.write(json_format.MessageToJson(response, indent=None) + "\n")
            self.out.flush()
        return self.options.as_json

    def note(self, text: str) -> None:
        """A line from the client itself (not the planner): stdout, or stderr in JSON
        mode so that stdout stays one JSON object per line."""
        if self.options.as_json:
            print(text, file=self.err, flush=True)
        else:
            self.renderer.line(text)

    async def send(self, text: str) -> str:
        """Send ``text`` as a message of the open session; returns its request id."""
        assert self._call is not None and self.session is not None
        text = utf8_text(text)
        request_id = uuid.uuid4().hex
        self.renderer.sent.append(text)
        self.pending[request_id] = text
        await self._write_message(request_id, text)
        if self.untitled:
            self.untitled = False
            await self._title(text)
        return request_id

    async def _write_message(self, request_id: str, text: str) -> None:
        assert self._call is not None
        await self._call.write(
            chat_pb2.ChatRequest(
                request_id=request_id, send_message=chat_pb2.SendMessageAction(text=text)
            )
        )

    async def _title(self, text: str) -> None:
        # A session created by the interactive client gets its first message as title, so
        # /sessions tells sessions apart; failing to set it changes nothing else.
        assert self.session is not None
        session = resources_pb2.Session(
            session_id=self.session.session_id, title=short(text, TITLE_CHARS)
        )
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.stub.UpdateSession(
                planner_service_pb2.UpdateSessionRequest(
                    session=session, update_mask=field_mask_pb2.FieldMask(paths=["title"])
                ),
                metadata=self._metadata(),
                timeout=10,
            )

    async def cancel(self) -> bool:
        """Ask to cancel the running turn; False when none runs (yet)."""
        if not self.running_turn or self._call is None:
            return False
        await self._call.write(
            chat_pb2.ChatRequest(
                request_id=uuid.uuid4().hex,
                cancel_turn=chat_pb2.CancelTurnAction(turn_id=self.running_turn),
            )
        )
        return True

    async def close(self) -> None:
        """Close the stream and the channel."""
        await self._close_stream()
        if self.channel is not None:
            await self.channel.close()

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
        return list(listed.messages)[-RESUME_MESSAGES:]

    async def list_sessions(self) -> None:
        """Print the project's sessions, newest first (the current one marked ``*``)."""
        project = self.session.project_id if self.session else self.options.project_id
        try:
            listed = await self.stub.ListSessions(
                planner_service_pb2.ListSessionsRequest(project_id=project, page_size=20),
                metadata=self._metadata(),
                timeout=10,
            )
        except grpc.aio.AioRpcError as error:
            self.note("error: " + describe_status(*_error_of(error)))
            return
        if self.options.as_json:
            print(json_format.MessageToJson(listed, indent=None), file=self.out, flush=True)
            return
        current = self.session.session_id if self.session else ""
        self.note(f"sessions of {project} (newest first):")
        for session in listed.sessions:
            mark = "*" if session.session_id == current else " "
            updated = session.update_time.ToDatetime().strftime("%Y-%m-%d %H:%M")
            title = session.title or "(untitled)"
            self.note(f" {mark} {session.session_id}  {updated}  {title}")
        if listed.next_page_token:
            self.note("   (more; the newest 20 are shown)")


# --------------------------------------------------------------------------- modes


async def _pump(client: ChatClient) -> None:
    """Read the stream until the planner closes it, reopening when needed."""
    while True:
        event = await client.next_event()
        if event is _End.REOPEN:
            await client.reopen()
        elif event is _End.CLOSED:
            return


async def run_once(client: ChatClient, text: str) -> int:
    """Send ``text``, show the turn, return 0 for COMPLETED or MAX_ROUNDS, else 1."""
    request_id = await client.send(text)
    client.waiting = _Turn(request_id=request_id, text=text)
    waiting = client.waiting
    while waiting.ended is None and not waiting.refused:
        event = await client.next_event()
        if event is _End.REOPEN:
            await client.reopen()
        elif event is _End.CLOSED:
            raise ChatError("the planner closed the stream before the turn ended")
    if waiting.refused:
        print(f"ballet-planner chat: message refused: {waiting.refused}", file=client.err)
        return 1
    ended = waiting.ended
    assert ended is not None
    if ended.reason in _ENDED_OK:
        return 0
    print(f"ballet-planner chat: the turn ended {describe_turn_end(ended)}", file=client.err)
    return 1


class _Interactive:
    """The interactive loop: lines in, commands, the stream pumped meanwhile."""

    def __init__(self, client: ChatClient, lines: LineSource) -> None:
        self.client = client
        self.lines = lines
        self.pump: asyncio.Task[None] | None = None
        self.quit = asyncio.Event()
        self._cancel_asked = False
        self._tasks: set[asyncio.Task[bool]] = set()

    def start_pump(self) -> None:
        self.client.on_idle = self.idle
        self.pump = asyncio.get_running_loop().create_task(_pump(self.client))

    async def stop_pump(self) -> None:
        if self.pump is not None:
            self.pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.pump
            self.pump = None

    def idle(self) -> None:
        self._cancel_asked = False
        self.prompt()

    def prompt(self) -> None:
        if not self.client.options.as_json:
            self.client.renderer.end_line()
            self.client.renderer.write("> ")

    def header(self, created: bool) -> None:
        session = self.client.session
        assert session is not None
        how = "new session" if created else "session"
        self.client.note(
            f"{how} {session.session_id} in project {session.project_id} "
            f"({session.owner_id} on {self.client.options.address})"
        )
        for message in self.client.recent:
            self.client.renderer.message(message)
        self.client.recent.clear()

    async def run(self) -> int:
        self.client.note(_HELP)
        self.header(created=not self.client.options.session_id)
        self.start_pump()
        self.prompt()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGINT, self._interrupt)
        try:
            return await self._loop()
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGINT)
            await self.stop_pump()

    def _interrupt(self) -> None:
        if self.client.busy and not self._cancel_asked:
            self._cancel_asked = True
            self.client.note("(cancelling the turn; Ctrl-C again quits)")
            task = asyncio.get_running_loop().create_task(self.client.cancel())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self.quit.set()

    async def _loop(self) -> int:
        line_task: asyncio.Task[str | None] | None = None
        quit_task = asyncio.get_running_loop().create_task(self.quit.wait())
        try:
            while True:
                if line_task is None:
                    line_task = asyncio.get_running_loop().create_task(self.lines.get())
                assert self.pump is not None
                pump = self.pump
                done, _ = await asyncio.wait(
                    {line_task, pump, quit_task}, return_when=asyncio.FIRST_COMPLETED
                )
                if quit_task in done:
                    return 0
                if pump in done:
                    pump.result()  # raises ChatError when the stream failed
                    raise ChatError("the planner ended the chat stream (was it stopped?)")
                if line_task in done:
                    line = line_task.result()
                    line_task = None
                    if line is None or not await self._handle(line.strip()):
                        return 0
        finally:
            quit_task.cancel()
            if line_task is not None:
                line_task.cancel()

    async def _handle(self, line: str) -> bool:
        """Act on one typed line; False to quit."""
        client = self.client
        if not line:
            self.prompt()
            return True
        if line.startswith("/"):
            command, _, argument = line.partition(" ")
            if command in ("/quit", "/exit"):
                return False
            if command == "/help":
                client.note(_HELP)
            elif command == "/cancel":
                if await client.cancel():
                    client.note("(cancelling)")
                    return True
                client.note("(no turn is running)" if not client.busy else "(not started yet)")
            elif command == "/new":
                await self._switch("")
            elif command == "/open":
                if not argument.strip():
                    client.note("usage: /open SESSION_ID (see /sessions)")
                else:
                    await self._switch(argument.strip())
            elif command == "/sessions":
                await client.list_sessions()
            else:
                client.note(f"unknown command {command}; /help lists them")
            if not client.busy:
                self.prompt()
            return True
        if client.busy:
            client.note("(a turn is running: wait for it, or /cancel it)")
            return True
        await client.send(line)
        return True

    async def _switch(self, session_id: str) -> None:
        await self.stop_pump()
        client = self.client
        if client.busy:
            client.note("(the running turn goes on; /open its session to follow it)")
        client.running_turn = ""
        client.pending.clear()
        try:
            if session_id:
                await client.resume(session_id)
            else:
                await client.open()
                client.untitled = True
        except ChatError as error:
            client.note(f"error: {error}")
            # Back to the session we had, so the chat goes on.
            await client.reopen()
        else:
            self.header(created=not session_id)
        self.start_pump()


def utf8_text(text: str) -> str:
    """``text`` as protobuf can encode it: bytes that were not UTF-8 (a terminal or argv
    in another encoding) reach Python as lone surrogates; they become U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


async def run_chat(
    options: ChatOptions,
    *,
    lines: LineSource | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Run the chat; returns the exit code (see the module docstring). Raises
    ``ChatError`` when the planner cannot be reached, refuses the token, or the project
    or session does not exist."""
    from service.adapters.channels import make_channel

    client = ChatClient(options, out or sys.stdout, err or sys.stderr)
    try:
        client.channel = make_channel(options.address, tls=None, insecure=False)
    except ValueError as error:
        raise ChatError(f"--address {options.address}: {error}") from None
    try:
        if options.session_id:
            await client.resume(options.session_id)
        elif options.message is not None:
            await client.open(title=short(options.message, TITLE_CHARS))
        else:
            await client.open()
            client.untitled = True
        if options.message is not None:
            return await run_once(client, options.message)
        return await _Interactive(client, lines or LineSource()).run()
    finally:
        await client.close()
