"""The bare baselines every ratio divides by (phase 1)."""

from __future__ import annotations

from bench import database
from bench.bare import MESSAGE_BYTES, BareClient
from bench.context import (
    BenchContext,
)
from bench.report import Row, time_row
from bench.scenarios import ITEM_ID
from bench.stats import repeated_medians, repeated_values


class Baselines(BenchContext):
    """The bare baselines every ratio divides by (phase 1)."""

    async def bare_baselines(self) -> None:
        s = self.sizes
        client = BareClient(self.env.bare_address)
        section = "Bare baselines (loopback, same run)"
        try:
            await client.unary(50)
            await client.new_stream(50)
            await client.ping_pong(50)
            unary = repeated_medians([await client.unary(s.unary) for _ in range(s.bare_runs)])
            stream = repeated_medians(
                [await client.new_stream(s.new_stream) for _ in range(s.bare_runs)]
            )
            ping = repeated_medians(
                [await client.ping_pong(s.ping_pong) for _ in range(s.bare_runs)]
            )
            rates = [await client.stream_rate(s.stream_messages) for _ in range(3)]
        finally:
            await client.close()
        insert = repeated_medians(
            await database.insert_commit_psycopg(self.env.planner_url, s.bare_runs, s.insert)
        )
        insert_sa = repeated_medians(
            await database.insert_commit_sqlalchemy(self.env.planner_url, s.bare_runs, s.insert)
        )
        rate = repeated_values(rates, s.stream_messages)
        add = self.report.add
        add(time_row(section, "bare.unary", "grpc.aio unary echo", unary))
        add(time_row(section, "bare.new_stream", "new server-streaming call (1 message)", stream))
        add(time_row(section, "bare.ping_pong", "ping-pong on an open bidi stream", ping))
        add(
            Row(
                section,
                "bare.stream_rate",
                f"server stream of {MESSAGE_BYTES}-byte messages",
                "msg/s",
                rate.value,
                rate.low,
                rate.high,
                f"3x{s.stream_messages}",
            )
        )
        add(time_row(section, "bare.insert", "INSERT + COMMIT (psycopg)", insert))
        add(
            time_row(
                section, "bare.insert_sa", "INSERT + COMMIT (SQLAlchemy async engine)", insert_sa
            )
        )
        self.bare = {
            "unary": unary.value,
            "new_stream": stream.value,
            "ping_pong": ping.value,
            "stream_rate": rate.value,
            "insert": insert.value,
        }
        # The dependencies as the planner calls them, directly from here.
        await self.set_scenario()
        for _ in range(20):
            await self.deps.generate("round")
            await self.deps.get_item("demo", ITEM_ID)
        generate = repeated_medians(
            [
                [(await self.deps.generate("round")).latency_s for _ in range(s.new_stream // 3)]
                for _ in range(s.bare_runs)
            ]
        )
        get_item = repeated_medians(
            [
                [await self.deps.get_item("demo", ITEM_ID) for _ in range(s.unary // 3)]
                for _ in range(s.bare_runs)
            ]
        )
        dep = "Dependencies called directly (devstack on PostgreSQL, scripted model)"
        add(time_row(dep, "dep.generate", "model call (scripted, one tool call)", generate))
        add(time_row(dep, "dep.get_item", "tracker GetItem (the get_item tool's RPC)", get_item))
        self.bare["generate"] = generate.value
        self.bare["get_item"] = get_item.value
        await self.stats()
