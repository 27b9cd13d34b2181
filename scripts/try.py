"""``scripts/try``: from a fresh clone to a chat with the planner, in one command.

1. Sets the checkout's virtualenv up when needed (``scripts/setup.py try``: created if
   missing, the planner and its devstack installed editable; a rerun reuses them).
2. Starts ``ballet-planner dev`` with its defaults (planner ``127.0.0.1:50051``, devstack
   ``127.0.0.1:50052``, metrics ``127.0.0.1:9464``, state in ``./.ballet-dev``, the
   scripted demo model); arguments are passed to ``dev`` (e.g. ``--address
   127.0.0.1:0`` for any free port, ``--provider openai``), but ``--session ID`` and
   ``--user NAME``, which go to the chat (resume that session; chat as that dev user
   instead of alice, e.g. ``bob``, who may only read). ``dev`` runs in its own
   session, so Ctrl-C in the chat reaches the chat only; its output goes to a log file.
3. Opens ``ballet-planner chat`` as alice (or ``--user``) in the same terminal, on the address and
   project ``dev`` reported (its ``--ready-file``). Lines piped in are sent one by one, as
   with ``chat`` itself: ``echo "What are the open epics?" | scripts/try``.
4. When the chat ends (``/quit``, Ctrl-D, the end of the piped input), stops ``dev`` as
   Ctrl-C would and says so; exits with the chat's exit code.

Its own lines go to stderr, so stdout holds the chat's transcript alone
(docs/decisions/0320-two-commands.md). Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import setup  # the sibling script, found through the path above

ROOT = setup.ROOT
#: How long dev may take to start (a first start migrates and loads the demo: ~3 s).
START_LIMIT_S = 120.0
#: dev's own stop takes at most its server.grace_s (20 s by default); then SIGKILL.
STOP_LIMIT_S = 30.0
#: Who the chat is, unless ``--user`` names another dev user.
USER = "alice"
#: The last line of dev's banner.
BANNER_END = "Stop with Ctrl-C."


def say(message: str) -> None:
    # OSError: the terminal is gone (its window closed); nobody reads this, and what
    # follows (stopping dev) must still happen.
    with contextlib.suppress(OSError):
        print(f"scripts/try: {message}", file=sys.stderr, flush=True)


def wait_ready(ready: Path, dev: subprocess.Popen[bytes]) -> dict[str, str] | None:
    """What dev wrote to its ready file; None when it exited first."""
    deadline = time.monotonic() + START_LIMIT_S
    while not ready.exists():
        try:
            dev.wait(0.05)
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                say(f"dev did not get ready within {START_LIMIT_S:.0f} s")
                return None
            continue
        return None
    values: dict[str, str] = json.loads(ready.read_text(encoding="utf-8"))
    return values


def stop(dev: subprocess.Popen[bytes]) -> int:
    """Stop dev as Ctrl-C does (SIGINT: its running turns get their grace to end, then it
    stops), saying so first, since a turn may hold the stop up for seconds; a Ctrl-C
    meanwhile is dev's second one (it stops at once). Returns dev's exit code."""
    if dev.poll() is None:
        dev.send_signal(signal.SIGINT)
        say("stopping dev (a running turn may take a few seconds to end; Ctrl-C stops it at once)")
        try:
            try:
                return dev.wait(STOP_LIMIT_S)
            except KeyboardInterrupt:
                dev.send_signal(signal.SIGINT)
                return dev.wait(STOP_LIMIT_S)
        except subprocess.TimeoutExpired:
            dev.kill()
    return dev.wait()


def said_after_banner(log: Path) -> list[str]:
    """dev's own lines after its banner (what the stop waited for, "stopped")."""
    text = log.read_text(errors="replace") if log.exists() else ""
    _, _, after = text.partition(BANNER_END)
    return [
        # Its Ctrl-C hint is stale once it has stopped (stop() gave it up front).
        line.removesuffix("; press Ctrl-C again to stop at once")
        for line in after.splitlines()
        if line.startswith("ballet-planner dev: ")
    ]


def tail(log: Path, lines: int = 15) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def text_logs(argv: list[str]) -> list[str]:
    """dev's logs go to a file a human reads: text lines, unless the arguments choose."""
    return [] if any(arg.startswith("--log-format") for arg in argv) else ["--log-format", "text"]


def chat_arguments(argv: list[str]) -> tuple[list[str], list[str], str | None]:
    """``argv`` split into dev's arguments, the chat's ``--session ID`` (as the chat
    names it in its hints), and the user of ``--user NAME`` (None without it; "" when
    its name is missing)."""
    rest: list[str] = []
    chat: list[str] = []
    user: str | None = None
    words = iter(argv)
    for word in words:
        if word == "--session":
            chat += [word, next(words, "")]
        elif word.startswith("--session="):
            chat.append(word)
        elif word == "--user":
            user = next(words, "")
        elif word.startswith("--user="):
            user = word.partition("=")[2]
        else:
            rest.append(word)
    return rest, chat, user


def _leave(signum: int, _frame: object) -> None:
    # SIGTERM, or SIGHUP when the terminal closes: leave through main's `finally`, which
    # stops dev (in its own session, nothing else would). Once: a second signal must not
    # cut that `finally` short.
    for other in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(other, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv):
        # The docstring's markup is for readers of the code, not of a terminal.
        try:
            print((__doc__ or "").replace("``", ""), flush=True)
        except BrokenPipeError:
            # Read by ``| head``, which left: no traceback, and nothing left to flush.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    argv, resume, named = chat_arguments(argv)
    if resume and not (resume[-1] if len(resume) == 2 else resume[0].partition("=")[2]).strip():
        # Before anything is installed or started: a resume without its session.
        say("--session needs a session id")
        return 2
    if named is not None and not named.strip():
        say("--user needs a dev user's name (alice, bob, ...: dev's banner lists them)")
        return 2
    user = named or USER
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _leave)
    try:
        python = setup.ensure("try")
    except setup.SetupError as error:
        say(str(error))
        return 1
    planner = python.with_name("ballet-planner")
    work = Path(tempfile.mkdtemp(prefix="ballet-try-"))
    log, ready = work / "dev.log", work / "ready.json"
    keep_log = False
    chatting: subprocess.Popen[bytes] | None = None
    with log.open("wb") as out:
        dev = subprocess.Popen(
            [str(planner), "dev", "--ready-file", str(ready), *text_logs(argv), *argv],
            cwd=Path.cwd(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            # Its own session: Ctrl-C typed in the chat is the chat's, not dev's.
            start_new_session=True,
        )
    try:
        values = wait_ready(ready, dev)
        if values is None:
            code = stop(dev)
            keep_log = True
            said = tail(log)
            say(f"dev did not start (exit {code}); what it said (all of it in {log}):\n{said}")
            free_ports = (
                "--address 127.0.0.1:0 --devstack-address 127.0.0.1:0 --metrics-address 127.0.0.1:0"
            )
            if "in use by another `ballet-planner " in said:
                # Another dev (or serve) holds the data directory, and likely its ports.
                say(
                    "the arguments of scripts/try go to dev: `scripts/try --data-dir "
                    f".ballet-dev-2 {free_ports}` runs a second one beside it, with its own "
                    "data and free ports"
                )
            elif "in use" in said:
                say(
                    f"the arguments of scripts/try go to dev: `scripts/try {free_ports}` "
                    "takes free ports"
                )
            return code or 1
        say(
            f"dev is running: planner {values['address']}, devstack "
            f"{values['devstack_address']}, data {values['data_dir']} (its log while it runs: "
            f"{log})"
        )
        say(f"chatting as {user} about project {values['project']}; /quit or Ctrl-D leaves")
        chat = [
            str(planner),
            "chat",
            "--address",
            values["address"],
            "--project",
            values["project"],
            "--user",
            user,
            "--data-dir",
            values["data_dir"],
            *resume,
        ]
        # The terminal's Ctrl-C reaches the chat, which decides what it means; this
        # process waits for the chat to end, then stops dev.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            chatting = subprocess.Popen(chat)
            return chatting.wait()
        finally:
            signal.signal(signal.SIGINT, previous)
    finally:
        if chatting is not None and chatting.poll() is None:
            chatting.terminate()  # this process was told to leave: the chat goes too
            try:
                chatting.wait(10)
            except subprocess.TimeoutExpired:
                chatting.kill()
        stopped = stop(dev)
        for line in said_after_banner(log):
            say(line.removeprefix("ballet-planner "))
        # 130: the stop's SIGINT (or a second Ctrl-C) cut dev's start or its stop short.
        if stopped not in (0, 128 + signal.SIGINT, -signal.SIGINT) and not keep_log:
            keep_log = True
            say(f"dev exited with {stopped}; its log: {log}")
        if not keep_log:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        # Ctrl-C while setting up or starting dev: dev was stopped on the way out.
        sys.exit(130)
