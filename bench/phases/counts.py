"""T1 and T2: commits, statements and CPU of one turn at concurrency 1."""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
from collections.abc import Awaitable, Callable
from typing import Any

from bench import database
from bench.client import ChatError, channel
from bench.context import (
    PROJECTS,
    SOLO,
    BenchContext,
    Rotating,
    log,
    others,
    ours,
)
from bench.report import Row, compare, judge, time_row
from bench.stack import human_id, project_ids
from bench.stats import Repeated, repeated_medians


class Counts(BenchContext):
    """T1 and T2: commits, statements and CPU of one turn at concurrency 1."""

    async def t1_counts(self, stream: Rotating) -> None:
        """Count what one one-round turn makes (after warm-up: prompt cached)."""
        probe = await database.ServerProbe.connect(self.env.planner_url)
        section = "T1: what a one-round turn makes (counted)"
        try:
            per_turn: list[dict[str, int]] = []
            # A fresh session before counting: opening one is a write of its own.
            await stream.fresh()
            await self.stats()
            for _ in range(5):
                sql_counts = await self._sql_counted(probe, lambda: self.turns(stream, 1))
                counts = await self.stats()
                calls = counts["calls"]
                per_turn.append(
                    {
                        "model": int(counts["model"].get("turn", 0)),
                        "compaction": int(counts["model"].get("compaction", 0)),
                        "tool": int(calls.get("GetItem", 0)),
                        "prompt": int(calls.get("GetProject", 0)) + int(calls.get("ReadSkill", 0)),
                        **sql_counts,
                    }
                )
            two_replicas = await self._t1_two_replicas(stream, probe)
            # A human's first turn in a project: the system prompt is not cached yet.
            fresh = await self.stream(SOLO, project=project_ids(PROJECTS)[-1])
            await self.stats()
            xid = await probe.next_xid()
            await self.turns(fresh, 1)
            first_writes = await probe.next_xid() - xid
            first = await self.stats()
            fresh.cancel()
        finally:
            await probe.close()

        def median(name: str) -> float:
            return statistics.median(turn[name] for turn in per_turn)

        def spread(name: str) -> tuple[float, float]:
            values = [turn[name] for turn in per_turn]
            return min(values), max(values)

        add = self.report.add
        add(
            judge(
                Row(section, "t1.chat", "Chat requests (send_message)", "count", 1, samples="5"),
                "1",
                True,
            )
        )
        row = Row(
            section,
            "t1.model",
            "turn-purpose model calls",
            "count",
            median("model"),
            *spread("model"),
            samples="5",
        )
        add(judge(row, "2", spread("model") == (2, 2)))
        row = Row(
            section,
            "t1.tool",
            "tool calls (GetItem RPCs)",
            "count",
            median("tool"),
            *spread("tool"),
            samples="5",
        )
        add(judge(row, "1", spread("tool") == (1, 1)))
        row = Row(
            section,
            "t1.writes",
            "write transactions (commits that wrote)",
            "count",
            median("writes"),
            *spread("writes"),
            samples="5",
            note="xid advance; a lease renewal may add one",
        )
        add(judge(row, "<= 3", median("writes") <= 3))
        if per_turn[0]["statements"] >= 0:
            row = Row(
                section,
                "t1.statements",
                "SQL statements (planner database)",
                "count",
                median("statements"),
                *spread("statements"),
                samples="5",
                note="pg_stat_statements, top level; a heartbeat or lease renewal may add one",
            )
            add(judge(row, "<= 12", median("statements") <= 12))
            row = Row(
                section,
                "t1.notifies",
                "pg_notify statements, one replica",
                "count",
                median("notifies"),
                *spread("notifies"),
                samples="5",
                note="decision 0340: no other replica follows the session",
            )
            add(judge(row, "0", spread("notifies")[1] == 0))
        self._t1_two_replica_rows(section, two_replicas)
        row = Row(
            section,
            "t1.prompt",
            "system-prompt RPCs, cached",
            "count",
            median("prompt"),
            *spread("prompt"),
            samples="5",
        )
        add(judge(row, "0", spread("prompt")[1] == 0))
        first_prompt = int(first["calls"].get("GetProject", 0)) + int(
            first["calls"].get("ReadSkill", 0)
        )
        row = Row(
            section,
            "t1.prompt_first",
            "system-prompt RPCs, first turn of a human in a project",
            "count",
            first_prompt,
            samples="1",
            note=f"{first_writes} write transactions",
        )
        add(judge(row, "<= 2", first_prompt <= 2))
        self.figures["t1"] = {
            "per_turn": per_turn,
            "first": first,
            "first_writes": first_writes,
            "two_replicas": two_replicas,
        }

    async def _sql_counted(
        self, probe: database.ServerProbe, run: Callable[[], Awaitable[object]]
    ) -> dict[str, int]:
        """What ``run`` made the planner database do: write transactions (xid advance),
        statements and ``pg_notify`` statements (``pg_stat_statements``). (Transactions
        of every kind are not counted: ``pg_stat_database`` hears of them only when each
        backend flushes its counts, at most once a second, and the listener's heal read
        adds one a second; measured so, they scattered from -3 to 14 per turn.)"""
        xid = await probe.next_xid()
        statements = await probe.statements()
        notifies = await probe.notifies()
        await run()
        writes = await probe.next_xid() - xid
        sql = await probe.statements() - statements
        notified = await probe.notifies() - notifies
        return {"writes": writes, "statements": sql, "notifies": notified}

    async def _t1_two_replicas(
        self, stream: Rotating, probe: database.ServerProbe
    ) -> dict[str, Any]:
        """The counts of T1 with a second replica following the session (a stream there
        attached to it): what the signal costs, and that the follower sees every event in
        order."""
        log("T1: one-round turns with a second replica following the session")
        other = await self.env.start_planner("planner-b")
        chan = channel(str(other.ready["address"]))
        seen: list[int] = []
        progress = asyncio.Event()
        reader: asyncio.Task[None] | None = None
        try:
            await stream.fresh()
            await self.turns(stream, 1)
            follower = await self.stream(human_id(0), session_id=stream.session_id, chan=chan)

            async def read() -> None:
                while True:
                    response = await follower._read()
                    if response.sequence:
                        seen.append(response.sequence)
                        progress.set()

            reader = asyncio.create_task(read())
            for _ in range(100):
                if await probe.follows(stream.session_id) >= 2:
                    break
                await asyncio.sleep(0.05)
            follows = await probe.follows(stream.session_id)
            per_turn: list[dict[str, int]] = []

            async def turn_seen_there() -> None:
                await self.turns(stream, 1)
                target = stream.last_sequence
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(5.0):
                        while not seen or seen[-1] < target:
                            progress.clear()
                            await progress.wait()

            for _ in range(5):
                per_turn.append(await self._sql_counted(probe, turn_seen_there))
            in_order = bool(seen) and seen == list(range(seen[0], seen[0] + len(seen)))
            complete = bool(seen) and seen[-1] == stream.last_sequence
            follower.cancel()
        finally:
            if reader is not None:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, ChatError):
                    await reader
            await chan.close()
            await asyncio.to_thread(other.stop)
        return {
            "per_turn": per_turn,
            "follows": follows,
            "in_order": in_order,
            "complete": complete,
            "events_seen": len(seen),
        }

    def _t1_two_replica_rows(self, section: str, two: dict[str, Any]) -> None:
        per_turn: list[dict[str, int]] = two["per_turn"]
        for key, label in (
            ("writes", "write transactions, a second replica following (pg_notify's included)"),
            ("statements", "SQL statements, a second replica following"),
            ("notifies", "pg_notify statements, a second replica following"),
        ):
            values = [turn[key] for turn in per_turn]
            row = Row(
                section,
                f"t1.two.{key}",
                label,
                "count",
                statistics.median(values),
                min(values),
                max(values),
                samples=str(len(values)),
                note=f"{two['follows']} replicas follow the session",
            )
            self.report.add(row)
        row = Row(
            section,
            "t1.two.in_order",
            "events seen on the second replica, in order and complete",
            "count",
            float(two["events_seen"]),
            samples="1",
        )
        self.report.add(judge(row, "all, in order", two["in_order"] and two["complete"]))

    async def concurrency_one(self) -> Rotating:
        s = self.sizes
        b = self.bare
        stream = Rotating(self, human_id(0))
        await self.set_scenario(rounds=1)
        await self.turns(stream, s.warmup)
        await self.t1_counts(stream)
        log("T2: one-round turns at concurrency 1")
        meter = self.cpu()
        meter.start()
        batches = [
            [r.latency_s for r in await self.turns(stream, s.turns)] for _ in range(s.turn_runs)
        ]
        cpu = meter.stop()
        done = s.turns * s.turn_runs
        one = repeated_medians(batches)
        await self.set_scenario(rounds=s.rounds)
        # Four-round turns store 10 messages each: renew sessions more often.
        stream = Rotating(self, human_id(0), every=4)
        await self.turns(stream, 3)
        multi = repeated_medians(
            [
                [r.latency_s for r in await self.turns(stream, s.round_turns)]
                for _ in range(s.turn_runs)
            ]
        )
        await self.set_scenario(rounds=1)
        stream.cancel()
        stream = Rotating(self, human_id(0))
        section = "T2: cost of a turn and of a round (concurrency 1)"
        add = self.report.add
        bare_turn = b["ping_pong"] + 2 * b["new_stream"] + b["unary"] + 4 * b["insert"]
        row = time_row(section, "t2.turn", "one-round turn, p50", one)
        compare(row, "ping-pong + 2 new streams + unary + 4 INSERT+COMMIT", bare_turn * 1000)
        judge(row, "<= 1.5x", (row.ratio or 99) <= 1.5)
        add(row)
        dep_turn = b["ping_pong"] + 2 * b["generate"] + b["get_item"] + 4 * b["insert"]
        row = time_row(
            section, "t2.turn_deps", "one-round turn, p50, vs the real dependency calls", one
        )
        add(compare(row, "ping-pong + 2 model calls + GetItem + 4 INSERT+COMMIT", dep_turn * 1000))
        per_round = Repeated(
            runs=tuple((m - o) / (s.rounds - 1) for m, o in zip(multi.runs, one.runs, strict=True)),
            per_run=multi.per_run,
        )
        bare_round = b["new_stream"] + b["unary"] + 2 * b["insert"]
        row = time_row(
            section,
            "t2.round",
            f"one more round (({s.rounds}-round turn - one-round turn) / {s.rounds - 1})",
            per_round,
        )
        compare(row, "new stream + unary + 2 INSERT+COMMIT", bare_round * 1000)
        judge(row, "<= 1.5x", (row.ratio or 99) <= 1.5)
        add(row)
        row = time_row(
            section, "t2.round_deps", "one more round vs the real dependency calls", per_round
        )
        add(
            compare(
                row,
                "model call + GetItem + 2 INSERT+COMMIT",
                (b["generate"] + b["get_item"] + 2 * b["insert"]) * 1000,
            )
        )
        add(time_row(section, "t2.multi", f"{s.rounds}-round turn, p50", multi))
        section4 = "T4: CPU per turn (concurrency 1) and throughput"
        total = sum(ours(cpu).values())
        self.report.notes.append(
            f"Other work on the machine during the concurrency-1 turns: "
            f"{others(cpu) / meter.wall_s:.2f} cores busy outside the benchmark's processes "
            f"(of {os.cpu_count()})."
        )
        for name, seconds in ours(cpu).items():
            add(
                Row(
                    section4,
                    f"t4.cpu.{name}",
                    f"CPU per one-round turn: {name}",
                    "ms",
                    seconds / done * 1000,
                    samples=str(done),
                )
            )
        add(
            Row(
                section4,
                "t4.cpu.total",
                "CPU per one-round turn: all processes",
                "ms",
                total / done * 1000,
                samples=str(done),
            )
        )
        self.figures["cpu1"] = {name: seconds / done for name, seconds in ours(cpu).items()}
        self.figures["cpu1_total"] = total / done
        self.figures["turn1"] = one.value
        return stream
