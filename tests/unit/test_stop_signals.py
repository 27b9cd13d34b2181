"""``ballet_common.signals``: the first SIGINT/SIGTERM starts the graceful stop, a second
one hurries it and makes the exit code ``128 + signum`` (decision 0185). Real signals
to this process, handled by the event loop: nothing raises ``KeyboardInterrupt``."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

from ballet_common.signals import HURRY_S, StopSignals, stop_when_signalled

WAIT_S = 10.0


class Stopper:
    """A stop that runs until hurried, recording the grace of each call."""

    def __init__(self) -> None:
        self.calls: list[float | None] = []
        self.started = asyncio.Event()
        self._hurried = asyncio.Event()

    async def stop(self, grace: float | None) -> None:
        self.calls.append(grace)
        if grace is None:
            self.started.set()
            await self._hurried.wait()
        else:
            self._hurried.set()


async def test_a_second_signal_hurries_the_stop_in_progress() -> None:
    stopper = Stopper()
    said: list[tuple[str, int]] = []
    with StopSignals("test") as signals:
        waiting = asyncio.ensure_future(
            stop_when_signalled(
                signals,
                stopper.stop,
                on_stop=lambda signum: said.append(("stop", signum)),
                on_hurry=lambda signum: said.append(("hurry", signum)),
            )
        )
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.wait_for(stopper.started.wait(), WAIT_S)
        os.kill(os.getpid(), signal.SIGTERM)
        code = await asyncio.wait_for(waiting, WAIT_S)
    assert stopper.calls == [None, HURRY_S]
    assert said == [("stop", signal.SIGINT), ("hurry", signal.SIGTERM)]
    assert code == 128 + signal.SIGTERM


async def test_one_signal_stops_gracefully_with_exit_code_0() -> None:
    calls: list[float | None] = []

    async def stop(grace: float | None) -> None:
        calls.append(grace)

    with StopSignals("test") as signals:
        waiting = asyncio.ensure_future(stop_when_signalled(signals, stop))
        os.kill(os.getpid(), signal.SIGTERM)
        code = await asyncio.wait_for(waiting, WAIT_S)
    assert (calls, code) == ([None], 0)


async def test_signals_go_back_to_python_after_the_block() -> None:
    with StopSignals("test"):
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


STUCK = """
import asyncio
from ballet_common.signals import StopSignals, stop_when_signalled

async def main() -> int:
    async def stop(grace):
        await asyncio.Event().wait()  # a stop that never ends, hurried or not

    with StopSignals("stuck") as signals:
        print("ready", flush=True)
        return await stop_when_signalled(
            signals,
            stop,
            on_stop=lambda signum: print("stopping", flush=True),
            on_hurry=lambda signum: print("hurrying", flush=True),
        )

raise SystemExit(asyncio.run(main()))
"""


def test_a_third_signal_ends_a_stuck_stop_at_once() -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", STUCK], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        for line, then in (("ready", signal.SIGINT), ("stopping", signal.SIGINT)):
            assert process.stdout.readline().strip() == line
            process.send_signal(then)
        assert process.stdout.readline().strip() == "hurrying"
        process.send_signal(signal.SIGINT)
        code = process.wait(WAIT_S)
        errors = process.stderr.read() if process.stderr is not None else ""
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert code == 128 + signal.SIGINT
    assert errors == (
        "stuck: a third SIGINT: stopped at once, without cleaning up; running turns are left "
        "for the sweeper\n"
    )
