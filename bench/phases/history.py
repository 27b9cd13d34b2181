"""T3: replay and listing of a long history."""

from __future__ import annotations

import time

from bench import database
from bench.client import ChatError
from bench.context import (
    SOLO,
    BenchContext,
)
from bench.report import compare, judge, time_row
from bench.stats import Repeated, repeated_medians


class History(BenchContext):
    """T3: replay and listing of a long history."""

    async def history(self) -> None:
        s = self.sizes
        section = "T3: cost per round with long transcripts (a summary covers all but the last 20)"
        # (messages stored, messages after the summary); the last case shows what the
        # messages the model sees cost, against the first three's 20.
        cases = ((100, 20), (1000, 20), (10_000, 20), (1000, 200))
        results: dict[tuple[int, int], Repeated] = {}
        seed_s: dict[int, float] = {}
        batches: dict[tuple[int, int], list[list[float]]] = {case: [] for case in cases}
        # Runs outside, cases inside: a drift of the machine's load over the phase then
        # touches every case alike instead of the last one.
        for run in range(s.history_runs):
            for count, kept in cases:
                creator = await self.stream(SOLO)
                session_id = creator.session_id
                creator.cancel()
                started = time.monotonic()
                await database.seed_transcript(self.env.planner_url, session_id, SOLO, count, kept)
                seed_s[count] = time.monotonic() - started
                # A fresh session per run: each turn adds 4 messages after the summary.
                stream = await self.stream(SOLO, session_id=session_id, after=count)
                await self.turns(stream, 1)
                batches[(count, kept)].append(
                    [r.latency_s for r in await self.turns(stream, s.history_turns)]
                )
                stream.cancel()
                if count == 10_000 and run == 0:
                    await self._probe_replay(session_id, count)
        for case, runs in batches.items():
            results[case] = repeated_medians(runs)
        add = self.report.add
        base = results[(100, 20)].value * 1000
        for (count, kept), figure in results.items():
            label = f"one-round turn p50, {count:,} messages stored"
            if kept != 20:
                label += f", the last {kept} after the summary"
            row = add(time_row(section, f"t3.turn{count}_{kept}", label, figure))
            if (count, kept) != (100, 20):
                compare(row, "the same with 100 messages", base)
            if (count, kept) == (10_000, 20):
                judge(row, "<= 1.1x", (row.ratio or 99) <= 1.1)
        self.report.notes.append(
            f"T3 sessions are seeded with direct SQL inserts (10,000 messages and events in "
            f"{seed_s.get(10_000, 0):.1f} s) and a fresh session per run, so every run's turns "
            f"see 20 to {20 + 4 * (s.history_turns + 1)} messages after the summary."
        )

    async def _probe_replay(self, session_id: str, count: int) -> None:
        try:
            stream = await self.stream(SOLO, session_id=session_id, after=0)
            stream.cancel()
            self.report.limits.append(
                f"Replay: opening a {count:,}-message session with after_sequence 0 was accepted."
            )
        except ChatError as error:
            self.report.limits.append(
                f"Replay: opening a session of {count:,} events with after_sequence 0 is refused "
                f"({error}); planner.max_replay_events is 1,000: clients page with ListMessages "
                "and open with a recent after_sequence (the T3 streams open at the last sequence)."
            )
