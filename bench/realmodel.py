"""``python -m bench realmodel``: the context estimate after a compaction, against a real
llama.cpp server.

It starts ``llama-server`` (``scripts/llama-server``'s cached build, SmolLM2-135M-Instruct,
the repository's tool-capable template, pinned sampling with the repeat penalty of
``tests/realmodel/support.ENDING_SAMPLING``: without it the model never ends a summary)
and a planner wired to it through the devstack gateway's ``openai`` provider
(``tests/realmodel/support.py``), with ``planner.compact_at_tokens`` low enough that the
second turn of a session compacts. After the compaction the planner knows no reported
usage, so it estimates the next request (the fixed prompt, the summary and the latest
human message), calibrated to the model's count as learned from earlier answers
(decision 0350); the server then reports that request's input tokens. The figure is the
estimate over the reported count, read from
``ballet_planner_context_estimate_ratio{purpose="turn"}`` over the second turn (one
observation: its one model call), with the compaction marker's estimate (the one that
decided to compact) and the answer's reported input beside it.

The model's tokenizer is not cl100k, the estimator's reference (``service/core/estimate.py``),
and its chat template renders the tool declarations as indented JSON: uncalibrated, the
estimate is about a quarter below what the server reports (the ``raw`` column).

Options: ``--compact-at TOKENS`` (default 1800), ``--rounds N`` (default 3: sessions
measured).
Prints one line per session and the mean; exits 1 when the build is absent or no
compaction was accepted (the refusals by cause are then printed).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ballet.planner.v1 import resources_pb2

from tests.realmodel.support import (
    ENDING_SAMPLING,
    BuildMissing,
    LlamaServer,
    RealPlanner,
    find_build,
    start_real_planner,
)

RATIO = "ballet_planner_context_estimate_ratio"
#: The two messages of each session: the second turn's compaction summarizes the first
#: (as in tests/realmodel/test_llama_server.py, whose summary of them is accepted).
FIRST, SECOND = "Reply with one word: hello.", "Reply with one word: ok."
#: The bound the figure is held to: the estimate within 10 % of the reported input.
WITHIN = 0.10


@dataclass(frozen=True)
class Figure:
    """One session's figures, in tokens (``ratio`` is estimated / reported; ``factor``
    the calibration's when the estimate was made, ``raw`` the estimate without it)."""

    decided_at: int
    estimate: float
    reported: int
    ratio: float
    factor: float

    @property
    def raw(self) -> float:
        return self.estimate / self.factor


def _ratio_sample(planner: RealPlanner) -> tuple[float, float]:
    registry = planner.app.metrics.registry
    labels = {"purpose": "turn"}
    total = registry.get_sample_value(f"{RATIO}_sum", labels) or 0.0
    count = registry.get_sample_value(f"{RATIO}_count", labels) or 0.0
    return total, count


async def measure_one(planner: RealPlanner, index: int) -> Figure:
    """Two turns in a new session; the second compacts. Raises ``RuntimeError`` when no
    compaction happened or the answer reported no usage."""
    session = await planner.create_session()
    await planner.turn(FIRST, session)
    before = _ratio_sample(planner)
    factor = planner.app.parts.turns.turns.calibration.factor
    turn = await planner.turn(SECOND, session)
    after = _ratio_sample(planner)
    messages = await turn.transcript()
    markers = [m for m in messages if m.kind == resources_pb2.MESSAGE_KIND_COMPACTION]
    answers = [
        m
        for m in messages
        if m.kind == resources_pb2.MESSAGE_KIND_ASSISTANT and m.turn_id == turn.turn_id
    ]
    observations = after[1] - before[1]
    if not markers or not answers or observations < 1:
        failures = planner.compaction_failures()
        raise RuntimeError(
            f"session {index}: no compaction or no estimate observed (markers {len(markers)}, "
            f"answers {len(answers)}, observations {observations:g}, compaction failures "
            f"by reason {failures}); "
            f"turn ended {turn.ended.reason}: {turn.ended.error_message}"
        )
    ratio = (after[0] - before[0]) / observations
    reported = answers[-1].usage.input_tokens
    return Figure(markers[-1].estimated_tokens, ratio * reported, reported, ratio, factor)


async def run(compact_at: int, rounds: int) -> list[Figure]:
    build = find_build()
    with tempfile.TemporaryDirectory(prefix="bench-realmodel-") as tmp:
        work = Path(tmp)
        server = LlamaServer(
            build, work / "llama-server.log", template=build.template_tools, extra=ENDING_SAMPLING
        )
        await server.start()
        try:
            async with start_real_planner(
                server, work / "planner", PLANNER__COMPACT_AT_TOKENS=str(compact_at)
            ) as planner:
                figures = []
                for index in range(rounds):
                    if index:
                        # A fresh server for each session: llama-server reuses the cached
                        # prefix of the previous request, and a prompt evaluated in other
                        # batches can tip a greedy choice, so each session starts as the
                        # first did (tests/realmodel does the same with a server of its own).
                        await server.stop()
                        await server.restart()
                    figures.append(await measure_one(planner, index))
                return figures
        finally:
            await server.stop()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench realmodel", description=__doc__)
    parser.add_argument("--compact-at", type=int, default=1800)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        figures = asyncio.run(run(args.compact_at, args.rounds))
    except (BuildMissing, RuntimeError) as exc:
        print(exc, file=sys.stderr)
        return 1
    print("After a compaction, the next request: the planner's estimate and the input tokens")
    print("llama-server reported (SmolLM2-135M-Instruct's tokenizer); the estimate is")
    print("calibrated by the factor learned so far (decision 0350), the raw one is without it")
    print(
        f"{'session':>7} {'decided at':>10} {'factor':>6} {'raw':>6} {'estimate':>9} "
        f"{'reported':>9} {'raw ratio':>9} {'ratio':>6}"
    )
    for index, figure in enumerate(figures):
        print(
            f"{index:>7} {figure.decided_at:>10} {figure.factor:>6.3f} {figure.raw:>6.0f} "
            f"{figure.estimate:>9.0f} {figure.reported:>9} {figure.raw / figure.reported:>9.3f} "
            f"{figure.ratio:>6.3f}"
        )
    mean = statistics.fmean(f.ratio for f in figures)
    within = all(abs(f.ratio - 1) <= WITHIN for f in figures)
    print(
        f"mean ratio {mean:.3f}: every estimate within {WITHIN:.0%} of the reported input: "
        f"{'yes' if within else 'no'}"
    )
    return 0
