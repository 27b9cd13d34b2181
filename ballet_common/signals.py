"""Stopping a server process on SIGINT and SIGTERM: once gracefully, twice at once
(decision 0185).

``ballet-planner serve``, ``ballet-planner dev`` and ``python -m devstack`` run until a
stop signal, then shut down within their grace period. People press Ctrl-C again when
that takes a while, so the signals stay handled by the event loop
(``loop.add_signal_handler``) for the whole shutdown: Python's default SIGINT handler
would raise ``KeyboardInterrupt`` in whatever frame runs at that instant (inside grpc's
Cython callbacks, a SQLAlchemy unit of work), and ``asyncio.run`` would then tear down a
loop with a gRPC server still running, which crashes the interpreter.

- The first SIGINT or SIGTERM starts the graceful stop: ``stop(None)``.
- A second one during the stop hurries it: ``stop(HURRY_S)``, which must shorten the
  stop in progress (``PlannerApp.stop`` does), and the process exits with
  ``128 + signal number`` (130 for SIGINT, 143 for SIGTERM), as a shell reports a
  process a signal ended.
- A third one, or a hurried stop that still runs ``HURRY_LIMIT_S`` seconds later, ends the
  process at once (``os._exit``) with one line on stderr: nothing is cleaned up, and
  running turns are left for the sweeper.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from types import TracebackType

log = logging.getLogger(__name__)

#: The signals that stop a server process.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: Seconds a stop hurried by a second signal gets, from that signal.
HURRY_S = 1.0
#: Seconds after the second signal past which the process exits without cleaning up.
HURRY_LIMIT_S = 5.0


def exit_code(signum: int) -> int:
    """The exit code of a process a signal stopped: ``128 + signum`` (130 for SIGINT,
    143 for SIGTERM), as shells report it."""
    return 128 + signum


def signal_name(signum: int) -> str:
    """``SIGINT``, ``SIGTERM``, ... for a signal number."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def stopping_message(grace_s: float, running: int, turns_end_within_s: float, hurry: str) -> str:
    """What a graceful stop waits for, and ``hurry``, how to skip it: "stopping: 1 running
    turn gets up to 13 s to end, then is interrupted; at most 20 s in all; press Ctrl-C
    again to stop at once". ``grace_s`` bounds the whole stop, ``running`` turns get
    ``turns_end_within_s`` seconds of it (``PlannerApp``; decisions 0181, 0185)."""
    if running:
        turns = "turn gets" if running == 1 else "turns get"
        waits = (
            f"{running} running {turns} up to {turns_end_within_s:g} s to end, then "
            f"{'is' if running == 1 else 'are'} interrupted; at most {grace_s:g} s in all"
        )
    else:
        waits = f"no turn running; at most {grace_s:g} s"
    return f"stopping: {waits}; {hurry}"


class StopSignals:
    """SIGINT and SIGTERM handled by the running event loop while the ``with`` block
    runs (enter it inside the loop; the main thread only, as ``add_signal_handler``
    requires).

    ``requested`` is set by the first signal, ``hurried`` by the second; ``signum`` is
    the number of the latest. ``name`` starts the line printed on stderr when a third
    signal ends the process at once.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.requested = asyncio.Event()
        self.hurried = asyncio.Event()
        self.signum = 0
        self.received = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> StopSignals:
        self._loop = asyncio.get_running_loop()
        for signum in STOP_SIGNALS:
            self._loop.add_signal_handler(signum, self._received, signum)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            for signum in STOP_SIGNALS:
                loop.remove_signal_handler(signum)

    @property
    def exit_code(self) -> int:
        """0 after a graceful stop; ``128 + signum`` when a second signal hurried it."""
        return exit_code(self.signum) if self.hurried.is_set() else 0

    def _received(self, signum: int) -> None:
        self.signum = signum
        self.received += 1
        if self.received == 1:
            self.requested.set()
        elif self.received == 2:
            self.hurried.set()
        else:
            exit_at_once(self.name, signum, f"a third {signal_name(signum)}")


def exit_at_once(name: str, signum: int, why: str) -> None:
    """End the process now with ``128 + signum``, saying ``why`` in one line on stderr;
    flushes the logs and stdout first. Nothing else runs: no ``finally``, no ``atexit``
    hook, no interpreter teardown (which is what makes it safe with live gRPC objects)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        os.write(
            sys.stderr.fileno(),
            f"{name}: {why}: stopped at once, without cleaning up; running turns are left "
            "for the sweeper\n".encode(),
        )
    logging.shutdown()
    os._exit(exit_code(signum))


async def stop_when_signalled(
    signals: StopSignals,
    stop: Callable[[float | None], Awaitable[None]],
    *,
    on_stop: Callable[[int], None] = lambda signum: None,
    on_hurry: Callable[[int], None] = lambda signum: None,
) -> int:
    """Wait for the first stop signal, then run ``stop(None)`` (the graceful stop) to its
    end; a second signal meanwhile calls ``stop(HURRY_S)`` beside it, which must shorten
    the stop in progress. ``on_stop`` and ``on_hurry`` are told the signal first (to say
    what happens). Returns the exit code (``StopSignals.exit_code``). A hurried stop
    still running ``HURRY_LIMIT_S`` seconds after the second signal ends the process
    (``exit_at_once``)."""
    await signals.requested.wait()
    on_stop(signals.signum)
    graceful = asyncio.ensure_future(stop(None))
    hurry = asyncio.ensure_future(signals.hurried.wait())
    try:
        await asyncio.wait({graceful, hurry}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hurry.cancel()
    if signals.hurried.is_set() and not graceful.done():
        on_hurry(signals.signum)
        hurried = asyncio.ensure_future(stop(HURRY_S))
        done, _ = await asyncio.wait({graceful, hurried}, timeout=HURRY_LIMIT_S)
        if len(done) < 2:
            exit_at_once(signals.name, signals.signum, f"the stop took over {HURRY_LIMIT_S} s")
        hurried.result()
    graceful.result()
    return signals.exit_code
