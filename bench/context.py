"""The shared context of a benchmark run (``BenchContext``) and what its phases use:
the phases themselves are in ``bench/phases/``, one module each, and ``bench.runner``
runs them in order."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from bench.client import ChatStream, Dependencies, Tokens, TurnResult, channel
from bench.procs import (
    CpuMeter,
)
from bench.report import Report
from bench.scenarios import scenario
from bench.stack import CONTROL, human_id

if TYPE_CHECKING:
    from bench.runner import Environment, Options, Sizes


COMPLETED = "TURN_END_REASON_COMPLETED"
PROJECTS = 10
HUMANS = 101
#: The human of the sessions measured alone (T3, T5's other session, T6).
SOLO = human_id(100)
#: The CPU source that is the whole machine, not a process of the benchmark.
MACHINE = "machine"


def ours(cpu: dict[str, float]) -> dict[str, float]:
    """The benchmark's own processes of a CPU reading (without ``MACHINE``)."""
    return {name: value for name, value in cpu.items() if name != MACHINE}


def others(cpu: dict[str, float]) -> float:
    """CPU that processes outside the benchmark took, from a reading with ``MACHINE``."""
    return max(0.0, cpu.get(MACHINE, 0.0) - sum(ours(cpu).values()))


def log(message: str) -> None:
    """Progress on stderr (the table goes to stdout)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Rotating:
    """One-round turns of one human in one project, on a fresh session every ``every``
    turns.

    The scripted model reports the same usage whatever the history, so the planner
    never compacts and a session used for hundreds of turns would make the model see
    hundreds of messages (a real model's growing usage would trigger compaction).
    Renewing the session keeps what each turn loads and sends at 0-40 messages; T3
    measures long transcripts on purpose. Opening the next session is not part of any
    turn's latency.
    """

    def __init__(
        self,
        bench: BenchContext,
        human: str,
        project: str = "demo",
        *,
        chan: grpc.aio.Channel | None = None,
        every: int = 10,
    ) -> None:
        self._bench = bench
        self._human = human
        self._project = project
        self._chan = chan
        self._every = every
        self._stream: ChatStream | None = None
        self._turns = 0

    async def fresh(self) -> None:
        """Open the next session now."""
        if self._stream is not None:
            self._stream.cancel()
        self._stream = await self._bench.stream(self._human, project=self._project, chan=self._chan)
        self._turns = 0

    async def turn(self, text: str = "round") -> TurnResult:
        if self._stream is None or self._turns >= self._every:
            await self.fresh()
        assert self._stream is not None
        self._turns += 1
        return await self._stream.turn(text)

    def cancel(self) -> None:
        if self._stream is not None:
            self._stream.cancel()

    @property
    def session_id(self) -> str:
        """The session of the stream open now ("" before the first)."""
        return self._stream.session_id if self._stream is not None else ""

    @property
    def last_sequence(self) -> int:
        """The last sequence the stream open now has read."""
        return self._stream.last_sequence if self._stream is not None else 0


class Turner(Protocol):
    """Anything that runs a turn: a ``ChatStream`` or a ``Rotating``."""

    async def turn(self, text: str) -> TurnResult: ...


@dataclass
class Load:
    """What a steady load saw: completions ``(monotonic end, latency s)``, errors, end
    reasons, CPU marks ``(monotonic, seconds by process)`` at window edges, and the most
    database connections of the planner seen."""

    completions: list[tuple[float, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)
    marks: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    connections: int = 0


class BenchContext:
    """What every phase of a run shares: the processes (``env``), the sizes, the report,
    the options, the channels to the planner and the stack, and the figures and bare
    baselines measured so far."""

    def __init__(self, env: Environment, sizes: Sizes, report: Report, options: Options) -> None:
        self.env = env
        self.sizes = sizes
        self.report = report
        self.options = options
        self.tokens = Tokens(env.work)
        self.chan = channel(env.planner_address)
        self.stack_chan = channel(env.stack_address)
        self._set_scenario = self.stack_chan.unary_unary(f"/{CONTROL}/SetScenario")
        self._stats = self.stack_chan.unary_unary(f"/{CONTROL}/Stats")
        self.deps = Dependencies(self.stack_chan, self.tokens, SOLO)
        self.bare: dict[str, float] = {}
        self.figures: dict[str, Any] = {}

    async def close(self) -> None:
        await self.chan.close()
        await self.stack_chan.close()

    # ------------------------------------------------------------------ helpers

    async def set_scenario(self, **kw: Any) -> None:
        await self._set_scenario(json.dumps(scenario(**kw)).encode())

    async def stats(self, *, reset: bool = True) -> dict[str, Any]:
        answer: dict[str, Any] = json.loads(await self._stats(b"reset" if reset else b""))
        return answer

    async def stream(
        self,
        human: str,
        *,
        project: str = "demo",
        session_id: str = "",
        after: int = 0,
        chan: grpc.aio.Channel | None = None,
    ) -> ChatStream:
        stream = ChatStream(chan or self.chan, self.tokens.human(human))
        await stream.open(project_id=project, session_id=session_id, after_sequence=after)
        return stream

    async def turns(self, stream: Turner, count: int, text: str = "round") -> list[TurnResult]:
        results = []
        for _ in range(count):
            result = await stream.turn(text)
            if result.reason != COMPLETED:
                raise RuntimeError(f"a {text!r} turn ended {result.reason}")
            results.append(result)
        return results

    def cpu(self) -> CpuMeter:
        return CpuMeter(self.env.cpu_sources())

    # ------------------------------------------------------------------ 1. bare
