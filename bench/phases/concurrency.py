"""T4: a steady load at 10 and 100 concurrent turns."""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import time

from bench import database
from bench.client import ChatError, channel
from bench.context import (
    COMPLETED,
    PROJECTS,
    BenchContext,
    Load,
    Rotating,
    others,
    ours,
)
from bench.report import Row, compare, judge, time_row
from bench.stack import human_id, project_ids
from bench.stats import Repeated, percentile, repeated_values


class Concurrency(BenchContext):
    """T4: a steady load at 10 and 100 concurrent turns."""

    async def _steady_load(
        self, streams: list[Rotating], warmup_s: float, windows: int, window_s: float
    ) -> Load:
        """Every stream runs one-round turns back to back for ``warmup_s`` plus
        ``windows`` x ``window_s`` seconds; completions and CPU are read per window.

        Windows are cut by time, not by turns: at 100 sessions a turn lasts longer than
        a short window, so a turn counts in the window where it completes.
        """
        load = Load()
        stop_at = time.monotonic() + warmup_s + windows * window_s
        probe = await database.ServerProbe.connect(self.env.planner_url)

        async def worker(stream: Rotating) -> None:
            while time.monotonic() < stop_at:
                try:
                    result = await stream.turn("round")
                except ChatError as error:
                    load.errors.append(str(error))
                    return
                load.reasons[result.reason] += 1
                load.completions.append((time.monotonic(), result.latency_s))

        async def sampler() -> None:
            sources = self.env.cpu_sources()
            await asyncio.sleep(warmup_s)
            for index in range(windows + 1):
                load.marks.append(
                    (time.monotonic(), {name: read() for name, read in sources.items()})
                )
                if index == windows:
                    return
                end = time.monotonic() + window_s
                # The planner's database connections, sampled through the window.
                while time.monotonic() < end:
                    load.connections = max(
                        load.connections, await probe.connections("ballet-planner")
                    )
                    await asyncio.sleep(min(0.25, max(0.0, end - time.monotonic())))

        try:
            await asyncio.gather(sampler(), *(worker(stream) for stream in streams))
        finally:
            await probe.close()
        return load

    async def concurrency(self, level: int, warmup_s: float, window_s: float) -> None:
        s = self.sizes
        projects = project_ids(PROJECTS)
        # At most 100 streams per connection, as a gateway multiplexing users would.
        chans = [channel(self.env.planner_address) for _ in range(max(1, level // 100))]
        streams = [
            Rotating(self, human_id(i % 100), projects[i % PROJECTS], chan=chans[i % len(chans)])
            for i in range(level)
        ]
        await asyncio.gather(*(stream.fresh() for stream in streams))
        try:
            load = await self._steady_load(streams, warmup_s, s.window_runs, window_s)
        finally:
            for stream in streams:
                stream.cancel()
            for chan in chans:
                await chan.close()
        rates, p50s, every = [], [], []
        cpu_runs: list[dict[str, float]] = []
        for (start, cpu_start), (end, cpu_end) in itertools.pairwise(load.marks):
            latencies = [lat for done, lat in load.completions if start < done <= end]
            if not latencies:
                raise RuntimeError(
                    f"no turn completed in a {window_s} s window at {level}: "
                    f"{load.errors[:3]} {load.reasons}"
                )
            rates.append(len(latencies) / (end - start))
            p50s.append(statistics.median(latencies))
            every += latencies
            cpu_runs.append(
                {name: (cpu_end[name] - cpu_start[name]) / len(latencies) for name in cpu_end}
            )
        errors, reasons, connections = load.errors, load.reasons, load.connections
        section = "T4: CPU per turn (concurrency 1) and throughput"
        rate = repeated_values(rates, len(every) // max(1, s.window_runs))
        add = self.report.add
        row = add(
            Row(
                section,
                f"t4.rate{level}",
                f"turns/s at {level} concurrent sessions",
                "turns/s",
                rate.value,
                rate.low,
                rate.high,
                f"{s.window_runs}x{window_s:g} s ({len(every)} turns)",
                note=f"after {warmup_s:g} s of warm-up",
            )
        )
        p50 = Repeated(runs=tuple(p50s), per_run=rate.per_run)
        add(time_row(section, f"t4.p50_{level}", f"turn latency p50 at {level}", p50))
        add(
            Row(
                section,
                f"t4.p99_{level}",
                f"turn latency p99 at {level} (pooled)",
                "ms",
                percentile(every, 99) * 1000,
                samples=str(len(every)),
            )
        )
        bad = sum(n for reason, n in reasons.items() if reason != COMPLETED)
        errors_row = add(
            Row(
                section,
                f"t4.errors{level}",
                f"errors and dropped streams at {level}",
                "count",
                len(errors) + bad,
                samples=str(len(every)),
                note="; ".join(sorted(set(errors)))[:200],
            )
        )
        judge(errors_row, "0", not errors and not bad)
        cpu_total = statistics.median(sum(ours(run).values()) for run in cpu_runs)
        busy_elsewhere = statistics.median(
            others(run) * rate_run for run, rate_run in zip(cpu_runs, rates, strict=True)
        )
        self.report.notes.append(
            f"Other work on the machine during the {level}-session windows: "
            f"{busy_elsewhere:.2f} cores busy outside the benchmark's processes."
        )
        cpu_planner = statistics.median(run["planner"] for run in cpu_runs)
        add(
            Row(
                section,
                f"t4.cpu{level}",
                f"CPU per turn at {level}: all processes",
                "ms",
                cpu_total * 1000,
                samples=str(len(every)),
            )
        )
        add(
            Row(
                section,
                f"t4.cpu_planner{level}",
                f"CPU per turn at {level}: planner",
                "ms",
                cpu_planner * 1000,
                samples=str(len(every)),
            )
        )
        add(
            Row(
                section,
                f"t4.db_conns{level}",
                f"planner database connections at {level} (max seen)",
                "count",
                connections,
                samples=f"{s.window_runs} windows",
                note=f"pool_size {self.env.overrides.get('database.pool_size', '10')} "
                "+ max_overflow 10",
            )
        )
        self.figures[f"rate{level}"] = rate.value
        if level == 10:
            cores = os.cpu_count() or 1
            ceiling = min(cores / self.figures["cpu1_total"], 1 / self.figures["cpu1"]["planner"])
            compare(row, "min(cores / all CPU per turn, 1 / planner CPU per turn) at 1", ceiling)
            judge(row, ">= 0.8x", (row.ratio or 0) >= 0.8)
            left = max(0.1, cores - busy_elsewhere)
            fair = min(left / self.figures["cpu1_total"], 1 / self.figures["cpu1"]["planner"])
            row = add(
                Row(
                    section,
                    "t4.rate10_left",
                    "turns/s at 10, against the cores other work left",
                    "turns/s",
                    rate.value,
                    rate.low,
                    rate.high,
                    row.samples,
                    note=f"{left:.2f} cores left",
                )
            )
            compare(row, "min(cores left / all CPU per turn, 1 / planner CPU per turn)", fair)
        if level == 100:
            compare(row, "turns/s at 10", self.figures["rate10"])
            judge(row, ">= 1.0x, no errors", (row.ratio or 0) >= 1.0 and not errors and not bad)
