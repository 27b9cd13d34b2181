"""T6: text deltas through the fan-out."""

from __future__ import annotations

import statistics

from bench.client import TurnResult
from bench.context import (
    SOLO,
    BenchContext,
    Rotating,
)
from bench.report import Row, compare, judge, time_row
from bench.stats import Repeated, repeated_medians, repeated_values


class Deltas(BenchContext):
    """T6: text deltas through the fan-out."""

    async def deltas(self) -> None:
        s = self.sizes
        section = "T6: text deltas"
        await self.set_scenario(rounds=1, long_deltas=s.long_deltas)
        stream = Rotating(self, SOLO)
        await self.turns(stream, 5, "ttfd")
        for _ in range(5):
            await self.deps.generate("ttfd")
        planner_runs: list[list[TurnResult]] = []
        direct_runs: list[list[TurnResult]] = []
        for _ in range(s.ttfd_runs):
            planner_runs.append(await self.turns(stream, s.ttfd, "ttfd"))
            direct_runs.append([await self.deps.generate("ttfd") for _ in range(s.ttfd)])
        via = repeated_medians([[r.first_delta_s or 0.0 for r in run] for run in planner_runs])
        direct = repeated_medians([[r.first_delta_s or 0.0 for r in run] for run in direct_runs])
        added = Repeated(
            runs=tuple(v - d for v, d in zip(via.runs, direct.runs, strict=True)),
            per_run=via.per_run,
        )
        relay_via = statistics.median(
            (recv - emit) / 1e9 for run in planner_runs for r in run for emit, recv in r.stamps
        )
        relay_direct = statistics.median(
            (recv - emit) / 1e9 for run in direct_runs for r in run for emit, recv in r.stamps
        )
        add = self.report.add
        add(
            time_row(
                section, "t6.ttfd", "time to first delta through the planner (send to delta)", via
            )
        )
        add(
            time_row(
                section, "t6.ttfd_direct", "time to first delta from the gateway directly", direct
            )
        )
        row = add(
            time_row(section, "t6.ttfd_added", "added by the planner (p50 difference)", added)
        )
        judge(row, "<= 1 ms", row.value <= 1.0)
        add(
            Row(
                section,
                "t6.relay",
                "of which after the model produced the delta (relay)",
                "ms",
                (relay_via - relay_direct) * 1000,
                samples=str(s.ttfd_runs * s.ttfd),
                note=f"planner path {relay_via * 1000:.2f} ms, direct {relay_direct * 1000:.2f} ms",
            )
        )
        # Pass-through of a long answer; a fresh session for each, since the answer
        # stays in the history the next turn would send to the model.
        stream.cancel()
        stream = Rotating(self, SOLO, every=1)
        await self.turns(stream, 1, "long")
        rates, messages, direct_rates = [], [], []
        for _ in range(s.long_runs):
            result = (await self.turns(stream, 1, "long"))[0]
            rates.append(s.long_deltas / result.delta_span_s if result.delta_span_s else 0.0)
            messages.append(result.deltas)
            if result.chars != s.long_deltas * 16:
                raise RuntimeError(f"the long answer arrived with {result.chars} characters")
            direct_result = await self.deps.generate("long")
            direct_rates.append(s.long_deltas / direct_result.delta_span_s)
        stream.cancel()
        rate = repeated_values(rates, s.long_deltas)
        row = Row(
            section,
            "t6.rate",
            f"model deltas passed per second ({s.long_deltas:,} x 16 chars)",
            "deltas/s",
            rate.value,
            rate.low,
            rate.high,
            f"{s.long_runs}x{s.long_deltas}",
            note=f"delivered in {int(statistics.median(messages)):,} messages "
            "(queued deltas merge)",
        )
        compare(row, "bare server stream msg/s", self.bare["stream_rate"])
        judge(row, ">= 0.5x", (row.ratio or 0) >= 0.5)
        add(row)
        direct_rate = repeated_values(direct_rates, s.long_deltas)
        row = Row(
            section,
            "t6.rate_direct",
            "the gateway's own delta rate (called directly)",
            "deltas/s",
            direct_rate.value,
            direct_rate.low,
            direct_rate.high,
            f"{s.long_runs}x{s.long_deltas}",
        )
        add(compare(row, "bare server stream msg/s", self.bare["stream_rate"]))
        await self.set_scenario(rounds=1)
