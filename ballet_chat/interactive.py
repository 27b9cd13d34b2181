"""The interactive loop of ``ballet-planner chat`` (README.md; docs/decisions/0051 and
0165): lines in, commands, the session's stream pumped meanwhile.

A new session is created with the first message typed (its text is the title), never
at start; ``/new`` forgets the current one so that the next message starts another.
``/cancel`` (or Ctrl-C) while a message is being accepted cancels its turn as soon as the
turn starts. A message typed while an answer streams is queued (``on_busy`` ENQUEUE: it
runs when the answer ends, shown as queued); ``/interrupt TEXT`` stops the running turn
and sends TEXT at once (INTERRUPT; docs/decisions/0300-queued-turns.md and 0301).

When stdin is not a terminal (``printf 'a\nb\n' | ballet-planner chat ...``), nobody reads
a prompt or waits to type: the lines queue, each one (message or command) taken after
the previous turn has ended, and at the end of input the chat waits for the running
turn, then exits 0 when every message of its own was accepted and its turn ended
``COMPLETED`` or ``MAX_ROUNDS`` and every command did what it was asked, 1 otherwise;
errors go to stderr once, as with ``--message``
(docs/decisions/0166-chat-without-a-terminal.md).

A command that takes no argument (``/new``, ``/cancel``, ``/quit``, ...) refuses one
rather than ignoring it: ``/cancel TURN`` or ``/new TITLE`` would do something else
than what was meant.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any

import grpc
from ballet.planner.v1 import planner_service_pb2, resources_pb2
from google.protobuf import json_format

from ballet_chat.client import TITLE_CHARS, ChatClient, ChatError, pump
from ballet_chat.input import LineSource
from ballet_chat.render import (
    describe_status,
    describe_turn_end,
    error_of,
    short,
    terminal_safe,
)

PROMPT = "> "
#: The commands that take no argument: one given is refused, not ignored.
_WITHOUT_ARGUMENT = frozenset(
    {"/quit", "/exit", "/help", "/cancel", "/new", "/sessions", "/history"}
)
#: The exit code after Ctrl-C without a terminal (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130
#: How many of the project's newest sessions ``/open PREFIX`` looks among.
OPEN_PREFIX_SESSIONS = 100
HELP = (
    "Type a message and press Enter (arrow keys edit the line, up and down recall earlier "
    "ones). A message typed while the planner answers is queued and runs next. "
    "Commands: /interrupt TEXT (stop the answer and send TEXT now), /cancel (the running "
    "turn), /new (a new session), /sessions (this "
    "project's sessions, numbered), /open ROW or ID (another session: a /sessions row, or "
    "an id or its start), /history (every message of this session), /help, /quit (or "
    "Ctrl-D). A message that starts with / is typed with //. Ctrl-C cancels a running "
    "turn, or quits."
)


class Interactive:
    """The interactive chat over ``client``; ``lines`` default to the terminal's."""

    def __init__(self, client: ChatClient, lines: LineSource | None = None) -> None:
        self.client = client
        #: True while the prompt is on screen and nothing was typed after it. Set before
        #: the line reader starts: its thread asks for it as soon as a key is waiting,
        #: which a line typed while the chat connects already is.
        self.prompting = False
        self.lines = lines or LineSource(prompt=self._prompt_for_input)
        #: Lines come from a pipe or a file: they queue, no prompt, exit code by outcome.
        self.batch = not self.lines.terminal
        client.batch = self.batch
        self.pump: asyncio.Task[None] | None = None
        self.quit = asyncio.Event()
        #: Set when the client goes idle (no turn runs, no message waits to be accepted).
        self._idle = asyncio.Event()
        self._cancel_asked = False
        self._tasks: set[asyncio.Task[str]] = set()
        #: The session ids ``/sessions`` last listed, by row (``/open 2`` is the second).
        self.listed: list[str] = []
        #: Without a terminal, Ctrl-C stops the chat: the turn it cancelled (``""`` when
        #: none ran), None before any Ctrl-C (docs/decisions/0321-ctrl-c-in-the-chat.md).
        self.interrupted: str | None = None

    # -- the stream -------------------------------------------------------------

    def start_pump(self) -> None:
        self.client.on_idle = self.idle
        self.pump = asyncio.get_running_loop().create_task(pump(self.client))

    async def stop_pump(self) -> None:
        if self.pump is not None:
            self.pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.pump
            self.pump = None

    # -- output -----------------------------------------------------------------

    def idle(self) -> None:
        self._cancel_asked = False
        self._idle.set()
        self.prompt()

    def prompt(self) -> None:
        # A line being typed has its prompt; the chat prompts again once it is handled.
        renderer = self.client.renderer
        if not self.client.options.as_json and not self.batch and not renderer.holding:
            self.client.renderer.end_line()
            self.client.renderer.write(PROMPT)
            self.prompting = True
        self.lines.ready()

    def _prompt_for_input(self) -> str:
        # Called by the line reader's thread when the human starts typing: the output
        # waits until the line is entered (decision 0401), and the line is typed after
        # the prompt, the one on screen or, while an answer streams, on a line of its own.
        if self.client.options.as_json:
            return PROMPT if self.prompting else ""
        self.client.renderer.hold(new_line=not self.prompting)
        return PROMPT

    def header(self, created: bool) -> None:
        session = self.client.session
        assert session is not None
        how = "new session" if created else "session"
        self.client.note(
            f"{how} {session.session_id} in project {session.project_id} "
            f"({session.owner_id} on {self.client.options.address})"
        )
        if self.client.earlier_hidden and self.client.recent:
            self.client.note(
                f"(earlier messages are hidden; the latest {len(self.client.recent)} follow: "
                "/history shows them all)"
            )
        for message in self.client.recent:
            self.client.renderer.message(message)
        self.client.recent.clear()
        self.client.earlier_hidden = False

    def waiting_for_a_message(self) -> None:
        if self.batch:
            return
        self.client.note(
            f"project {self.client.options.project_id} on {self.client.options.address}: "
            "a new session starts with your first message"
        )

    # -- the loop ---------------------------------------------------------------

    async def run(self) -> int:
        """Until ``/quit``, end of input or a second Ctrl-C: 0 (without a terminal, 1
        when a message of this client was refused or its turn failed, or a command
        failed); 1 via ``ChatError`` when the stream fails."""
        if not self.batch:
            self.client.note(HELP)
        if self.client.session is not None:  # --session: resumed
            self.header(created=False)
            self.start_pump()
        else:
            self.waiting_for_a_message()
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
            self.lines.close()
            # A line left unentered (Ctrl-C, the stream ended): what it held is shown.
            self.client.renderer.release(unentered=True)
            # The prompt left on screen (Ctrl-C at it): what follows the chat (a shell's
            # prompt, scripts/try's lines) starts a line of its own.
            self.client.renderer.end_line()

    def _interrupt(self) -> None:
        if self.batch:
            self._interrupt_batch()
            return
        if self.client.busy and not self._cancel_asked:
            self._cancel_asked = True
            self.client.note("(cancelling the turn; Ctrl-C again quits)")
            task = asyncio.get_running_loop().create_task(self.client.request_cancel())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self.quit.set()

    def _interrupt_batch(self) -> None:
        """Ctrl-C without a terminal: no further line is sent; the running turn is
        cancelled and waited for; a second Ctrl-C (or none running) leaves at once."""
        client = self.client
        if self.interrupted is not None or not client.busy:
            if self.interrupted is None:
                self.interrupted = ""
            self.quit.set()
            return
        self.interrupted = client.running_turn or "pending"
        print(
            "ballet-planner chat: interrupted: cancelling the running turn; the remaining "
            "lines are not sent (Ctrl-C again leaves at once)",
            file=client.err,
            flush=True,
        )
        task = asyncio.get_running_loop().create_task(client.request_cancel())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _exit_code(self) -> int:
        if self.interrupted is not None:
            self._say_interrupted()
            return INTERRUPTED
        return 1 if self.batch and self.client.failed else 0

    def _say_interrupted(self) -> None:
        client = self.client
        if not self.interrupted:
            what = "no turn was running"
        elif client.busy:
            what = "the turn may still run on the planner (its cancel was not confirmed)"
        else:
            ended = client.ended.get(self.interrupted)
            if ended is None or ended.reason == resources_pb2.TURN_END_REASON_CANCELLED:
                what = "the turn was cancelled"
            else:
                what = f"the turn had ended before the cancel {describe_turn_end(ended)}"
        session = (
            f"; see the session with --session {client.session.session_id}"
            if client.session
            else ""
        )
        print(
            f"ballet-planner chat: interrupted: {what}; no further line was sent{session}",
            file=client.err,
            flush=True,
        )

    async def _loop(self) -> int:
        loop = asyncio.get_running_loop()
        line_task: asyncio.Task[str | None] | None = None
        quit_task = loop.create_task(self.quit.wait())
        try:
            while True:
                if self.interrupted is not None and not self.client.busy:
                    return self._exit_code()
                waiting: set[asyncio.Task[Any]] = {quit_task}
                idle_task: asyncio.Task[Any] | None = None
                if self.batch and self.client.busy:
                    # Without a terminal the next line waits for the turn to end (and
                    # the end of input for the last one), as a script expects.
                    self._idle.clear()
                    idle_task = loop.create_task(self._idle.wait())
                    waiting.add(idle_task)
                else:
                    if line_task is None:
                        line_task = loop.create_task(self.lines.get())
                    waiting.add(line_task)
                pumping = self.pump
                if pumping is not None:
                    waiting.add(pumping)
                try:
                    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if idle_task is not None:
                        idle_task.cancel()
                if quit_task in done:
                    return self._exit_code()
                if pumping is not None and pumping in done:
                    pumping.result()  # raises ChatError when the stream failed
                    raise ChatError("the planner ended the chat stream (was it stopped?)")
                if line_task is not None and line_task in done:
                    line = line_task.result()
                    line_task = None
                    self.prompting = False
                    if self.lines.echoes:
                        self.client.renderer.at_line_start()
                    self.client.renderer.release()
                    if line is None:  # end of input (Ctrl-D): leaves as /quit does
                        self._say_leaving()
                        return self._exit_code()
                    if not await self._handle(line.strip()):
                        return self._exit_code()
        finally:
            quit_task.cancel()
            if line_task is not None:
                line_task.cancel()

    def _say_leaving(self) -> None:
        """Leaving does not cancel: say where a running answer goes on."""
        client = self.client
        if client.busy and client.session is not None:
            client.renderer.end_line()
            client.note(
                "the running turn goes on on the planner; /cancel first to stop "
                f"it, or see its answer later with --session {client.session.session_id}"
            )

    async def _handle(self, line: str) -> bool:
        """Act on one typed line; False to quit."""
        client = self.client
        if not line:
            if not client.busy:
                self.prompt()
            return True
        if self.batch:
            # What a terminal would have shown as typed, so the transcript reads as one.
            client.note(PROMPT + line)
        if line.startswith("//"):
            # A message that starts with a slash (decision 0404).
            line = line[1:]
        elif line.startswith("/"):
            command, _, argument = line.partition(" ")
            argument = argument.strip()
            if command in ("/quit", "/exit") and not argument:
                self._say_leaving()
                return False
            await self._command(command, argument)
            if not client.busy:
                self.prompt()
            return True
        if client.holds_nothing:
            # A session made for a refused message is replaced: the next one is named
            # after a message it stores (its refused one is deleted, decision 0228).
            await self._leave()
        if client.session is None:
            await client.open(title=short(line, TITLE_CHARS))
            self.header(created=True)
            self.start_pump()
        # At a terminal, a message typed while a turn runs waits as a queued turn (shown
        # as queued); piped lines are sent one per ended turn, and refused as before when
        # another client's turn runs.
        on_busy = resources_pb2.ON_BUSY_REJECT if self.batch else resources_pb2.ON_BUSY_ENQUEUE
        await client.send(line, on_busy)
        return True

    def _refuse(self, why: str) -> None:
        """A command that could not do what it was asked: ``why`` is noted, and without
        a terminal the chat exits 1 at the end and ``why`` goes to stderr (as for a
        refused message)."""
        client = self.client
        client.failed += 1
        if self.batch:
            # A line of its own on stderr, not an aside in the transcript: no parentheses.
            if why.startswith("(") and why.endswith(")"):
                why = why[1:-1]
            print(f"ballet-planner chat: {terminal_safe(why)}", file=client.err, flush=True)
        else:
            client.note(why)

    async def _command(self, command: str, argument: str) -> None:
        client = self.client
        if argument and command in _WITHOUT_ARGUMENT:
            # Not ignored: "/cancel TURN" or "/new TITLE" would do something else than
            # what was meant.
            self._refuse(f"usage: {command} (it takes no argument; /help lists the commands)")
            return
        if command == "/help":
            client.note(HELP)
        elif command == "/interrupt":
            if not argument:
                self._refuse("usage: /interrupt TEXT (stops the running answer, sends TEXT)")
            elif client.session is None:
                await self._handle(argument)
            else:
                await client.send(argument, resources_pb2.ON_BUSY_INTERRUPT)
        elif command == "/cancel":
            when = await client.request_cancel()
            client.note(
                {"now": "(cancelling)", "later": "(cancelling the turn as soon as it starts)"}.get(
                    when, "(no turn is running)"
                )
            )
        elif command == "/new":
            await self._leave()
            self.waiting_for_a_message()
        elif command == "/open":
            if not argument:
                self._refuse("usage: /open ROW, or a session id or its start (see /sessions)")
            else:
                session_id = await self._session_named(argument)
                if session_id:
                    await self._open(session_id)
        elif command == "/sessions":
            await self._list_sessions()
        elif command == "/history":
            await self._history()
        else:
            self._refuse(f"unknown command {command}; /help lists them")

    async def _sessions(self, page_size: int) -> Any:
        """The project's newest sessions (a ``ListSessionsResponse``), or None after
        noting the error."""
        client = self.client
        project = client.session.project_id if client.session else client.options.project_id
        try:
            return await client.stub.ListSessions(
                planner_service_pb2.ListSessionsRequest(project_id=project, page_size=page_size),
                metadata=(("authorization", f"Bearer {client.token}"),),
                timeout=10,
            )
        except grpc.aio.AioRpcError as error:
            self._refuse("error: " + describe_status(*error_of(error)))
            return None

    async def _session_named(self, argument: str) -> str:
        """The session ``/open ARGUMENT`` means: row N of the last ``/sessions``, a whole
        id, or the one id among the project's newest sessions that starts with it;
        ``""`` after noting why there is none (no such row, an ambiguous start)."""
        if argument.isdigit() and len(argument) <= 3:
            row = int(argument)
            if 1 <= row <= len(self.listed):
                return self.listed[row - 1]
            if not self.listed:
                self._refuse("(list them with /sessions first, then /open ROW)")
            else:
                self._refuse(f"(no row {row}: /sessions listed {len(self.listed)})")
            return ""
        listed = await self._sessions(OPEN_PREFIX_SESSIONS)
        if listed is None:
            return ""
        ids = [session.session_id for session in listed.sessions]
        if argument in ids:
            return argument
        matching = [session_id for session_id in ids if session_id.startswith(argument)]
        if len(matching) > 1:
            self._refuse(
                f"({len(matching)} sessions start with {argument}: "
                f"{', '.join(matching[:5])}; give more of the id)"
            )
            return ""
        # No match among the newest: the whole id of an older (or another) session.
        return matching[0] if matching else argument

    async def _list_sessions(self) -> None:
        """Print the project's sessions, newest first, numbered for ``/open ROW`` (the
        current one marked ``*``)."""
        client = self.client
        project = client.session.project_id if client.session else client.options.project_id
        listed = await self._sessions(20)
        if listed is None:
            return
        self.listed = [session.session_id for session in listed.sessions]
        if client.options.as_json:
            print(json_format.MessageToJson(listed, indent=None), file=client.out, flush=True)
            return
        current = client.session.session_id if client.session else ""
        client.note(f"sessions of {project} (newest first):")
        for row, session in enumerate(listed.sessions, start=1):
            mark = "*" if session.session_id == current else " "
            updated = session.update_time.ToDatetime().strftime("%Y-%m-%d %H:%M")
            title = session.title or "(untitled)"
            client.note(f" {mark}{row:>3}  {session.session_id}  {updated}  {title}")
        if listed.next_page_token:
            client.note("   (more; the newest 20 are shown)")

    async def _history(self) -> None:
        """Print every message of the open session, oldest first."""
        client = self.client
        if client.session is None:
            client.note("(no session yet: your first message starts one)")
            return
        try:
            messages = await client.history()
        except ChatError as error:
            self._refuse(f"error: {error}")
            return
        count = f"{len(messages)} message" + ("" if len(messages) == 1 else "s")
        client.note(f"all {count} of session {client.session.session_id}:")
        for message in messages:
            client.renderer.message(message)

    async def _leave(self) -> None:
        await self.stop_pump()
        if self.client.busy:
            self.client.note("(the running turn goes on; /open its session to follow it)")
        await self.client.leave()

    async def _open(self, session_id: str) -> None:
        previous, after = self.client.session, self.client.last_sequence
        await self._leave()
        try:
            await self.client.resume(session_id)
        except ChatError as error:
            self._refuse(f"error: {error}")
            if previous is None:
                self.waiting_for_a_message()
                return
            # Back to the session we had, so the chat goes on.
            self.client.session, self.client.last_sequence = previous, after
            await self.client.reopen()
            self.start_pump()
            return
        self.header(created=False)
        self.start_pump()
