"""What the human types into ``ballet-planner chat`` (docs/decisions/0165-chat-client.md).

``LineSource`` reads lines in a daemon thread, so the event loop keeps serving the Chat
stream while the human types (``/cancel`` works mid-answer), and a read blocked on the
terminal never keeps the process from exiting after ``/quit``.

On a terminal, lines are read with the standard library's ``readline`` where it exists:
line editing (arrow keys move the cursor, they never reach the message) and history (the
up arrow recalls earlier messages). Output streams while no line is being edited, so the
reader waits for the first key with echo off (the terminal in cbreak mode, ``select``
on stdin) and only then starts ``input()``, with the prompt the chat gives (the chat
holds its output until the line is entered: decision 0401). The terminal's mode is
restored by ``close``.
Elsewhere (a pipe, a file, no ``readline``), lines are read as they come; escape
sequences typed on a terminal without ``readline`` are dropped from the line. Bytes that
are not text in the locale's encoding reach the line as lone surrogates (never an end of
input), and ``utf8_text`` makes them U+FFFD before the line is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, TextIO

#: Cursor and function keys as a terminal without line editing passes them through.
_ESCAPES = re.compile(r"\x1b(?:\[[0-9;?]*[ -/]*[@-~]|O.|.)?")
#: Back to the start of the line, and erase it (the prompt ``input()`` writes again).
_ERASE_LINE = "\r\x1b[K"


def _readline() -> ModuleType | None:
    try:
        import readline
    except ImportError:  # not on every platform (e.g. Windows)
        return None
    return readline


class LineSource:
    """Lines typed on ``stream`` (default stdin); ``get`` returns None at end of input.

    ``prompt`` is called by the reader when the human starts a line and returns the
    prompt ``input()`` should show (the chat's ``"> "``, or ``""``). ``echoes`` is True
    when the terminal showed the line and its Enter (the cursor is at the start of a new
    line after each one).
    """

    def __init__(
        self, stream: TextIO | None = None, *, prompt: Callable[[], str] | None = None
    ) -> None:
        self._stream = stream or sys.stdin
        self._prompt = prompt or (lambda: "")
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._terminal = _is_terminal(self._stream)
        self._readline = _readline() if self._terminal and self._stream is sys.stdin else None
        self._saved: list[Any] | None = None
        self._wake_read, self._wake_write = os.pipe()
        #: Set once the chat has shown its first prompt (``ready``): a line typed before
        #: then waits for it, so its echo lands after the prompt, in the transcript.
        self._ready = threading.Event()
        self.echoes = self._terminal
        #: A human types the lines (stdin is a terminal), not a pipe or a file.
        self.terminal = self._terminal
        # Bytes that are not text in the locale's encoding must not end the input (a
        # decoding error would look like its end): they reach the line as surrogates,
        # which ``utf8_text`` turns into U+FFFD when the line is read.
        reconfigure = getattr(self._stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(ValueError, OSError):
                reconfigure(errors="surrogateescape")
        target = self._read_edited if self._readline is not None else self._read_plain
        threading.Thread(target=target, name="chat-stdin", daemon=True).start()

    async def get(self) -> str | None:
        """The next line without its newline (valid UTF-8: see ``utf8_text``), or None
        at end of input."""
        line = await self._queue.get()
        return None if line is None else utf8_text(line.rstrip("\r\n"))

    def ready(self) -> None:
        """The chat has shown its first prompt: lines may be edited and echoed now."""
        self._ready.set()

    def close(self) -> None:
        """Stop waiting for keys and give the terminal back its mode (idempotent)."""
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"x")
        self._ready.set()
        if self._saved is not None:
            import termios

            with contextlib.suppress(OSError, termios.error):
                termios.tcsetattr(self._stream.fileno(), termios.TCSADRAIN, self._saved)

    def _deliver(self, line: str | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: we are exiting
            self._loop.call_soon_threadsafe(self._queue.put_nowait, line)

    def _read_plain(self) -> None:
        while True:
            try:
                line = self._stream.readline()
            except (OSError, ValueError):
                line = ""
            if line and self._terminal:
                line = _ESCAPES.sub("", line)
            self._deliver(line or None)
            if not line:
                return

    def _read_edited(self) -> None:
        import termios
        import tty

        fd = self._stream.fileno()
        try:
            self._saved = termios.tcgetattr(fd)
        except termios.error:
            self._read_plain()
            return
        while True:
            # Wait for the first key with echo off, so that text typed while an answer
            # streams does not land in it until line editing starts.
            tty.setcbreak(fd, termios.TCSANOW)
            try:
                ready, _, _ = select.select([fd, self._wake_read], [], [])
            except (OSError, ValueError):
                ready = [self._wake_read]
            if self._wake_read in ready:
                return
            # Keys typed while the chat was starting (before its first prompt) wait for
            # it: readline then echoes them after the prompt instead of among the start's
            # lines, where the prompt's erase or the next line would hide them.
            self._ready.wait()
            if self._closed():
                return
            # Back to the human's mode before readline starts: readline takes the mode it
            # finds as the one to restore, and shows nothing typed when echo is off.
            termios.tcsetattr(fd, termios.TCSANOW, self._saved)
            prompt = self._prompt()
            if prompt:
                # The chat showed the prompt; input() shows it again with the line.
                sys.stdout.write(_ERASE_LINE)
                sys.stdout.flush()
            try:
                line: str | None = input(prompt)
            except EOFError:
                # Ctrl-D leaves the cursor after the prompt: what follows starts a line.
                sys.stdout.write("\n")
                sys.stdout.flush()
                line = None
            except (OSError, ValueError):  # the terminal went away
                line = None
            self._deliver(line)
            if line is None:
                return

    def _closed(self) -> bool:
        ready, _, _ = select.select([self._wake_read], [], [], 0)
        return bool(ready)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError):
        return False


def utf8_text(text: str) -> str:
    """``text`` as protobuf can encode it: bytes that were not UTF-8 (a terminal or argv
    in another encoding) reach Python as lone surrogates; they become U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
