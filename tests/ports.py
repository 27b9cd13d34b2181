"""Ports in tests without a race (docs/decisions/0322-ports-bound-not-picked.md).

A port picked by binding a socket to port 0 and closing it is free only until someone
else takes it: another test, another suite beside this one, any program on the machine.
So no test does that (``tests/unit/test_no_port_race.py`` fails on the pattern):

- a server a test starts binds port 0 and says which port it got. ``serve``, ``dev`` and
  ``python -m devstack`` write their bound addresses to ``--ready-file PATH``;
  ``ready_file`` waits for it. In-process servers (``grpc.aio.server``,
  ``start_metrics_server``, ``asyncio.start_server``) return or expose the bound port.
- a port where nothing listens (a database that is down, an OTLP collector that is not
  there) is ``refused_port()``: a socket bound and never listening, held for the block,
  so connections to it are refused and nobody else can take it meanwhile.
- a program that cannot bind port 0 and say which it got is handed a listening socket
  (nginx: ``tests/polyglot/support.py``), or, when it must be told its port and binds with
  SO_REUSEADDR (PostgreSQL), gets a port held for it by a bound, never-listening
  SO_REUSEADDR socket until it listens (``tests/pg.py``).
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: How long a server process may take to write its ready file (a cold start is ~2 s).
READY_LIMIT_S = 60.0
#: How often the file is looked for, in seconds: each look waits on the process's exit.
_POLL_S = 0.05


class NotReady(AssertionError):
    """The process exited, or wrote no ready file in time; the message holds its log."""


def ready_file(
    path: Path,
    process: subprocess.Popen[Any],
    limit_s: float = READY_LIMIT_S,
    log: Path | None = None,
) -> dict[str, Any]:
    """The JSON object the process wrote to ``path`` (its ``--ready-file``) once it
    serves: ``address``, ``metrics_address`` and so on, as bound. Waits on the process
    between looks, so an exit is seen at once. Raises ``NotReady`` (an AssertionError)
    with ``log``'s text when it exits first or ``limit_s`` seconds pass."""
    deadline = time.monotonic() + limit_s
    while True:
        if path.exists():
            values: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
            return values
        try:
            code = process.wait(min(_POLL_S, max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                raise NotReady(f"no {path.name} within {limit_s} s{_tail(log)}") from None
            continue
        raise NotReady(f"the process exited with {code} before it was ready{_tail(log)}")


async def ready_file_async(
    path: Path,
    process: subprocess.Popen[Any],
    limit_s: float = READY_LIMIT_S,
    log: Path | None = None,
) -> dict[str, Any]:
    """``ready_file`` off the event loop (the test's in-process servers keep serving)."""
    return await asyncio.to_thread(ready_file, path, process, limit_s, log)


def _tail(log: Path | None) -> str:
    if log is None or not log.exists():
        return ""
    return ":\n" + log.read_text(errors="replace")[-8000:]


@contextmanager
def refused_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port on ``host`` where connections are refused for the length of the block: a
    socket bound to it that never listens. Nobody else can bind it meanwhile."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        yield port
