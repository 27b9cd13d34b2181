"""T5: idle Chat streams, and the per-human stream limit."""

from __future__ import annotations

import asyncio
import time

import grpc

from bench import database
from bench.client import ChatError, ChatStream, channel
from bench.context import (
    PROJECTS,
    SOLO,
    BenchContext,
    Rotating,
    others,
)
from bench.procs import (
    CpuMeter,
)
from bench.report import Row, compare, judge, time_row
from bench.stack import human_id, project_ids
from bench.stats import repeated_medians


class Streams(BenchContext):
    """T5: idle Chat streams, and the per-human stream limit."""

    async def idle_streams(self) -> None:
        s = self.sizes
        env = self.env
        assert env.planner is not None
        section = "T5: idle Chat streams"
        other = Rotating(self, SOLO, project_ids(PROJECTS)[1])
        await self.turns(other, 5)
        before_batches = [
            [r.latency_s for r in await self.turns(other, s.idle_turns)]
            for _ in range(s.idle_turn_runs)
        ]
        probe = await database.ServerProbe.connect(env.planner_url)
        chans: list[grpc.aio.Channel] = []
        idle: list[ChatStream] = []
        watchers: list[asyncio.Task[str]] = []
        try:
            connections_before = await probe.connections("ballet-planner")
            rss_before = env.planner.rss_bytes()
            cpu0 = env.planner.cpu_seconds()
            started = time.monotonic()
            await asyncio.sleep(s.idle_base_s)
            idle_base = (env.planner.cpu_seconds() - cpu0) / (time.monotonic() - started)
            # 100 streams per connection by default: the server allows 1,000 HTTP/2
            # streams on one (server.max_concurrent_streams), and a client multiplexes
            # onto few.
            per_channel = s.streams_per_channel
            chans = [channel(env.planner_address) for _ in range(-(-s.streams // per_channel))]
            projects = project_ids(PROJECTS)
            opened_at = time.monotonic()
            retried: list[str] = []

            async def open_one(i: int) -> ChatStream:
                # On a loaded machine a dependency may miss its deadline during the
                # opening burst; an open refused UNAVAILABLE is retried (twice at most).
                for attempt in range(3):
                    try:
                        return await self.stream(
                            human_id(i % 100),
                            project=projects[(i // 100) % PROJECTS],
                            chan=chans[i // per_channel],
                        )
                    except ChatError as error:
                        if attempt == 2 or "refused: 14 " not in str(error):
                            raise
                        retried.append(str(error))
                raise AssertionError("unreachable")

            for first in range(0, s.streams, 100):
                batch = await asyncio.gather(
                    *(open_one(i) for i in range(first, min(s.streams, first + 100)))
                )
                idle.extend(batch)
            open_s = time.monotonic() - opened_at
            if retried:
                self.report.notes.append(
                    f"T5: {len(retried)} opens were refused UNAVAILABLE and retried: "
                    + "; ".join(sorted(set(retried)))[:160]
                )
            loop = asyncio.get_running_loop()
            watchers = [loop.create_task(stream.wait_closed()) for stream in idle]
            # Let the planner finish the open work (replies, session creation) before
            # reading its memory: one turn on the other session goes through the loop.
            await self.turns(other, 1)
            rss_after = env.planner.rss_bytes()
            connections_after = await probe.connections("ballet-planner")
            meter = CpuMeter(env.cpu_sources())
            heartbeats = -sum(stream.heartbeats for stream in idle)
            meter.start()
            await asyncio.sleep(s.idle_s)
            idle_cpu = meter.stop()
            heartbeats += sum(stream.heartbeats for stream in idle)
            window = meter.wall_s
            during = repeated_medians(
                [
                    [r.latency_s for r in await self.turns(other, s.idle_turns)]
                    for _ in range(s.idle_turn_runs)
                ]
            )
            dropped = [task.result() for task in watchers if task.done()]
        finally:
            for task in watchers:
                task.cancel()
            for stream in idle:
                stream.cancel()
            for chan in chans:
                await chan.close()
            await probe.close()
        # The reference is measured before opening the streams and again after closing
        # them, so a drift of the machine's load over the phase does not pass for an
        # effect of the streams.
        after = [
            [r.latency_s for r in await self.turns(other, s.idle_turns)]
            for _ in range(s.idle_turn_runs)
        ]
        other.cancel()
        without = repeated_medians([*before_batches, *after])
        add = self.report.add
        per_stream = (rss_after - rss_before) / max(1, len(idle)) / 1024
        row = add(
            Row(
                section,
                "t5.rss",
                f"planner RSS growth per idle stream ({len(idle):,} open)",
                "KiB",
                per_stream,
                samples=str(len(idle)),
                note=f"RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB; "
                f"opened in {open_s:.1f} s",
            )
        )
        judge(row, "<= 64 KiB", per_stream <= 64)
        row = add(
            Row(
                section,
                "t5.db",
                "planner database connections, before -> with the streams",
                "count",
                connections_after,
                samples="1",
                note=f"before: {connections_before}",
            )
        )
        judge(row, "unchanged", connections_after <= connections_before)
        idle_share = idle_cpu["planner"] / window * 100
        self.report.notes.append(
            f"T5 idle window: PostgreSQL {idle_cpu.get('postgres', 0) / window * 100:.2f}% and "
            f"the stack {idle_cpu['stack'] / window * 100:.2f}% of a core; other work on the "
            f"machine {others(idle_cpu) / window:.2f} cores."
        )
        mode = "" if window >= 59 else f"; a {window:.0f} s window, not 60 s (--quick)"
        row = add(
            Row(
                section,
                "t5.cpu",
                "planner idle CPU with the streams open",
                "% of a core",
                idle_share,
                samples=f"{window:.0f} s",
                note=f"without them {idle_base * 100:.2f}%{mode}",
            )
        )
        judge(row, "<= 1%", idle_share <= 1.0)
        heartbeat = env.overrides.get("planner.stream_heartbeat_s")
        if heartbeat:
            interval = float(heartbeat)
            add(
                Row(
                    section,
                    "t5.heartbeat",
                    f"planner CPU per heartbeat interval ({interval:g} s), streams idle",
                    "ms",
                    idle_cpu["planner"] / window * interval * 1000,
                    samples=f"{window:.0f} s",
                    note=f"{idle_cpu['planner'] / window * interval / max(1, len(idle)) * 1e6:.1f}"
                    f" us per stream; {heartbeats:,} heartbeats read in the window, "
                    f"{len(idle) * window / interval:,.0f} expected",
                )
            )
        row = add(
            time_row(
                section, "t5.turn", "one-round turn on another session, p50, streams open", during
            )
        )
        compare(row, "the same without them (before and after)", without.value * 1000)
        judge(row, "<= 1.2x", (row.ratio or 99) <= 1.2)
        row = add(
            Row(
                section,
                "t5.dropped",
                "idle streams that ended or got events",
                "count",
                len(dropped),
                samples=str(len(idle)),
                note="; ".join(sorted(set(dropped)))[:120],
            )
        )
        judge(row, "0", not dropped)

    async def probe_stream_limit(self) -> None:
        """Open streams of one human until the planner refuses one (docs/spec/operations.md: 16)."""
        streams: list[ChatStream] = []
        refused = ""
        try:
            for _ in range(40):
                try:
                    streams.append(await self.stream(human_id(50)))
                except ChatError as error:
                    refused = str(error)
                    break
        finally:
            for stream in streams:
                stream.cancel()
        if refused:
            self.report.limits.append(
                f"Streams per human: stream {len(streams) + 1} of one human was refused "
                f"({refused[:90]}); limits.streams_per_human is 16, so 1,000 idle streams "
                "take at least 63 humans (the benchmark spreads them over 100)."
            )
