"""What ``ballet-planner chat`` shows (docs/spec/api-and-streams.md and README.md;
docs/decisions/0051).

Text deltas as they arrive, stitched by message id and character offset (a delta already
shown is skipped; the ``assistant_message`` completes what is missing); for each tool
call, a line as soon as the model names it (``-> name …``), one with its arguments once
they are complete (``-> name {args}``) and one with its result (``<- name: ok, 12
items`` or ``<- name: error NOT_FOUND: ...``); other clients' messages on the session
(``alice: text``), never this client's own; the model the planner named for the turn
(``turn_started``: the model the gateway was asked for, which ``dev`` names after the
model that answers, e.g. ``scripted demo``; never a local setting), when it first
appears or changes; one line when the turn ends. Counts take the right plural
(``1 item``, ``2 items``).

While the human types a line, output is held (``Renderer.hold``, from the line reader's
thread) and shown once the line is entered (``Renderer.release``), so that an answer
never streams into the line being edited; an answer cut mid-line by the typed line, or
by an aside (a note, a queued message), goes on after ``… `` (decision 0401).
"""

from __future__ import annotations

import json
import threading
from typing import TextIO

import grpc
from ballet.planner.v1 import chat_pb2, resources_pb2
from google.rpc import status_pb2

from ballet_common.grpc.status import code_name, from_status, parse

#: Where an answer cut mid-line by a typed line goes on.
CONTINUED = "… "
#: How many characters of a tool call's arguments and of a result summary are shown.
SHORT_CHARS = 100
#: Result keys whose singular is not the key without its final "s".
_SINGULAR = {"entries": "entry", "statuses": "status"}


def _visible_controls() -> dict[int, str]:
    """``str.translate``'s table for ``terminal_safe``."""
    table: dict[int, str] = {}
    for code in [*range(0x20), 0x7F]:
        if chr(code) not in "\n\t":
            # Caret notation, as ``cat -v`` shows them: ESC is ^[, BEL ^G, CR ^M, DEL ^?.
            table[code] = "^" + chr(code ^ 0x40)
    for code in [*range(0x80, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A)]:
        # C1 controls (0x9B opens a sequence as ESC [ does on some terminals) and the
        # bidirectional overrides, which reorder what a line seems to say.
        table[code] = f"<U+{code:04X}>"
    return table


_VISIBLE_CONTROLS = _visible_controls()


def terminal_safe(text: str) -> str:
    """``text`` with every control character but newline and tab made visible (``^[``
    for ESC, ``<U+202E>`` for a bidirectional override), and CR LF made LF. What the
    chat shows comes from the model, other humans and the planner's data: an escape
    sequence in it must not drive the terminal (colour it, retitle its window, move the
    cursor to overwrite a line; decision 0403)."""
    if text.isprintable():
        return text
    return text.replace("\r\n", "\n").translate(_VISIBLE_CONTROLS)


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 round``, ``0 rounds``, ``2 rounds``; ``nouns`` when not ``noun + "s"``."""
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"


def _counted(count: int, key: str) -> str:
    """``count`` of a result list named ``key`` (a plural such as ``items``)."""
    if count != 1:
        return f"{count} {key}"
    return f"1 {_SINGULAR.get(key, key[:-1] if key.endswith('s') else key)}"


class TextStitcher:
    """Stitches text deltas by message id and character offset (docs/spec/api-and-streams.md).

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
    """``text`` on one line, cut to ``limit`` characters with "…"; control characters
    (a NUL, an escape) count as spaces, so a title made of a message is one the planner
    takes."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else " " for c in text)
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
                return f"ok, {_counted(len(item), key)}{of}"
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


#: What a human reads for the reasons whose message tells an API client how to reopen a
#: stream (field names such as after_sequence mean nothing to a chat user; the chat
#: client reopens by itself).
PLAIN_MESSAGES = {
    "SHUTTING_DOWN": "the planner is stopping",
    "TOKEN_EXPIRED": "the token has expired",
    "REQUEST_STREAM_FAILED": "the planner could not read what this client sent",
    "SEQUENCE_OUT_OF_RANGE": "the session has fewer events than this client saw",
    "REPLAY_TOO_LARGE": "too much happened in the session to catch up at once; /open it",
    "INVALID_SEQUENCE": "this client asked for the session from a wrong place",
}


#: What to do when the planner answers but cannot reach a dependency (a ``serve`` started
#: without the devstack, say): the reason, and the hint the chat adds to it.
DEPENDENCY_UNAVAILABLE = "DEPENDENCY_UNAVAILABLE"
DEPENDENCY_HINT = (
    "the planner runs but cannot reach its tracker, skills, knowledge or LLM gateway: start "
    "them (`python -m devstack` beside `ballet-planner serve`, or run `ballet-planner dev` "
    "instead, which starts both), or check the planner's dependencies.* addresses"
)


def describe_status(code: str, reason: str, message: str) -> str:
    """``CODE REASON: message`` (reason left out when empty); for the reasons of
    ``PLAIN_MESSAGES``, their plain sentence instead of the planner's message; for a
    dependency the planner cannot reach, what to start (``DEPENDENCY_HINT``)."""
    message = PLAIN_MESSAGES.get(reason, message)
    if reason == DEPENDENCY_UNAVAILABLE:
        message = f"{message}; {DEPENDENCY_HINT}"
    return f"{code} {reason}: {message}" if reason else f"{code}: {message}"


def status_text(status: status_pb2.Status) -> tuple[str, str, str]:
    """A status carried in a message as (code name, ErrorInfo reason, message)."""
    return code_name(status.code), from_status(status).reason, status.message


def error_of(error: grpc.aio.AioRpcError) -> tuple[str, str, str]:
    """A failed call as (code name, ErrorInfo reason, message)."""
    failure = parse(error)
    return failure.code.name, failure.reason, failure.message


class Renderer:
    """Human-readable output of ``ChatResponse``s on ``out`` (see the module docstring)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.stitcher = TextStitcher()
        self._line_open = False
        #: Output held while the human types a line (``hold``), None when shown at once:
        #: what was asked, in order (``write``, ``line`` or ``end_line``) and its text.
        self._held: list[tuple[str, str]] | None = None
        #: A typed line cut the answer's line: the text that goes on with it starts with
        #: ``CONTINUED``.
        self._cut = False
        # ``hold`` comes from the line reader's thread, everything else from the loop's.
        self._lock = threading.Lock()
        #: The model last shown; a turn naming another one shows it again.
        self.model = ""
        #: The model the server last said answered (``Message.served_model``).
        self.served_model = ""

    def write(self, text: str) -> None:
        """Write ``text`` and flush (the terminal shows deltas as they come); held while
        the human types a line (``hold``)."""
        if text:
            self._out("write", text)

    def line(self, text: str) -> None:
        """Write ``text`` on a line of its own."""
        self._out("line", text)

    def aside(self, text: str) -> None:
        """Write ``text`` on a line of its own, as an aside that does not end the answer
        (a note, a message queued or sent by someone else): an answer whose line it
        interrupts goes on after it marked ``CONTINUED``, as after a typed line."""
        self._out("aside", text)

    def end_line(self) -> None:
        """Start a new line if the cursor is not at the start of one."""
        self._out("end_line", "")

    def at_line_start(self) -> None:
        """The terminal moved to a new line by itself (the human pressed Enter)."""
        with self._lock:
            self._line_open = False

    def hold(self, *, new_line: bool) -> None:
        """The human starts typing a line: hold the output until ``release``.
        ``new_line``: the typed line gets a line of its own (an answer streams), so an
        open line is ended and what goes on with it is marked ``CONTINUED``; else the
        prompt's line is the typed line's. Thread-safe: the line reader's thread calls it
        before the line is edited."""
        with self._lock:
            if self._held is not None:
                return
            self._held = []
            if new_line and self._line_open:
                self.out.write("\n")
                self.out.flush()
                self._cut = True
            self._line_open = False

    @property
    def holding(self) -> bool:
        """Whether the output is held (a line is being typed)."""
        with self._lock:
            return self._held is not None

    def release(self, *, unentered: bool = False) -> None:
        """The typed line was entered: show what was held meanwhile. ``unentered``: it
        was left as typed (the chat ends, a Ctrl-C or Ctrl-D in the line), so the line is
        ended first and what was held, or what follows the chat, starts a line of its
        own."""
        with self._lock:
            held, self._held = self._held, None
            if held is not None and unentered:
                # The typed line was not ended by Enter: end it before what was held.
                self.out.write("\n")
                self._line_open = False
            for kind, text in held or ():
                self._show(kind, text)

    def _out(self, kind: str, text: str) -> None:
        with self._lock:
            if self._held is not None:
                self._held.append((kind, text))
            else:
                self._show(kind, text)

    def _show(self, kind: str, text: str) -> None:
        """Show one ``write``, ``line``, ``aside`` or ``end_line``; the caller holds the
        lock."""
        if kind == "aside":
            interrupted = self._line_open
            self._show("line", text)
            self._cut = interrupted
            return
        if kind == "line":
            # A line of its own: the answer it follows is not cut, it ended or paused.
            self._cut = False
            self._show("end_line", "")
            text += "\n"
        elif kind == "end_line":
            if not self._line_open:
                return
            text = "\n"
        elif self._cut:
            self._cut = False
            if not text.startswith("\n"):
                text = CONTINUED + text
        text = terminal_safe(text)
        self.out.write(text)
        self.out.flush()
        self._line_open = not text.endswith("\n")

    def render(self, response: chat_pb2.ChatResponse, *, mine: bool = False) -> None:
        """Show one response; ``mine``: it is about a message this client sent (which
        is not echoed: the human just typed it)."""
        kind = response.WhichOneof("event")
        if kind == "text_delta":
            delta = response.text_delta
            self.write(self.stitcher.add(delta.message_id, delta.offset, delta.text))
        elif kind == "assistant_message":
            message = response.assistant_message.message
            rest = self.stitcher.finish(message.message_id, message.text)
            self.write(rest)
            self.write(cut_note(message))
            self.end_line()
            served = message.served_model
            if served and served not in (self.served_model, self.model):
                # The model as the server reports it (a local server names its file).
                self.served_model = served
                self.line(f"  (answered by {served})")
        elif kind == "message_accepted":
            message = response.message_accepted.message
            if not mine:
                self.line(f"{message.human_id or 'human'}: {message.text}")
        elif kind == "message_queued":
            queued = response.message_queued
            if mine and queued.on_busy == resources_pb2.ON_BUSY_INTERRUPT:
                self.aside(f"  (interrupting: {short(queued.text, 60)} runs next)")
            elif mine:
                self.aside(f"  (queued: {short(queued.text, 60)}; it runs when this answer ends)")
            else:
                self.aside(f"{queued.human_id or 'human'} (queued): {queued.text}")
        elif kind == "turn_started":
            model = response.turn_started.model
            if model and model != self.model:
                self.model = model
                self.line(f"  (model {model})")
        elif kind == "tool_call_progress":
            # The call's name, at once; its arguments come with tool_call_started.
            self.line(f"  -> {response.tool_call_progress.tool_name} …")
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
            self.line("error: " + describe_status(*status_text(response.error)))

    def message(self, message: resources_pb2.Message) -> None:
        """Show a stored message (a resumed session's history)."""
        if message.kind == resources_pb2.MESSAGE_KIND_HUMAN:
            self.line(f"{message.human_id or 'human'}: {message.text}")
        elif message.kind == resources_pb2.MESSAGE_KIND_ASSISTANT:
            if message.text:
                self.line(message.text + cut_note(message))
        elif message.kind == resources_pb2.MESSAGE_KIND_TOOL_CALL:
            self.line(f"  -> {message.tool_name} {short(message.tool_arguments or '{}')}")
        elif message.kind == resources_pb2.MESSAGE_KIND_TOOL_RESULT:
            summary = summarize_result(message.tool_result, message.tool_error)
            self.line(f"  <- {message.tool_name}: {summary}")
        elif message.kind == resources_pb2.MESSAGE_KIND_COMPACTION:
            self.line(f"  (compacted up to #{message.up_to})")


#: How the reasons an answer did not end normally read (``Message.finish_reason``).
_FINISHES = {
    "length": "the output limit",
    "content_filter": "the provider's content filter",
    "truncated": "the model's stream broke off",
}


def cut_note(message: resources_pb2.Message) -> str:
    """`` [cut: the output limit]``, `` [refused]``, `` [cut]`` or nothing; then
    `` [shortened: N bytes in all]`` for a copy the planner sent truncated (decision
    0222)."""
    shortened = f" [shortened: {message.original_bytes} bytes in all]" if message.truncated else ""
    if message.finish_reason == "refusal":
        return " [refused]" + shortened
    if not message.cut:
        return shortened
    why = _FINISHES.get(message.finish_reason, message.finish_reason)
    return (f" [cut: {why}]" if why else " [cut]") + shortened


def ended_ok(ended: chat_pb2.TurnEnded) -> bool:
    """True when a turn ended as a script may take as success: ``COMPLETED`` or
    ``MAX_ROUNDS`` (the turn stopped at its round limit; a new message continues)."""
    return ended.reason in (
        resources_pb2.TURN_END_REASON_COMPLETED,
        resources_pb2.TURN_END_REASON_MAX_ROUNDS,
    )


def describe_turn_end(ended: chat_pb2.TurnEnded) -> str:
    """``[COMPLETED: 1 round, 812 tokens]`` (tokens when the model reported usage), with
    the error of a failed turn; a turn whose answer called no tool (no round of tool
    calls) reads ``[COMPLETED: answered without tools]``, and one that ended otherwise
    before any tool call ``[CANCELLED: no tool called]``, never "0 rounds", which read as
    "nothing happened" (also after an answer that streamed)."""
    reason = resources_pb2.TurnEndReason.Name(ended.reason).removeprefix("TURN_END_REASON_")
    tokens = ended.usage.input_tokens + ended.usage.output_tokens
    if ended.rounds == 0 and ended.reason == resources_pb2.TURN_END_REASON_COMPLETED:
        text = f"[{reason}: answered without tools"
    elif ended.rounds == 0:
        text = f"[{reason}: no tool called"
    else:
        text = f"[{reason}: {plural(ended.rounds, 'round')}"
    text += f", {plural(tokens, 'token')}" if tokens else ""
    if ended.reason == resources_pb2.TURN_END_REASON_MAX_ROUNDS:
        text += "; send a message to continue"
    if ended.error_info.reason or ended.error_message:
        text += f"; {ended.error_info.reason}: {ended.error_message}"
    return text + "]"
