"""``python -m bench idle``: many idle Chat streams on one replica.

Opens ``--streams`` (default 10,000) Chat streams on as many new sessions, 1,000 per
client connection (HTTP/2 streams multiplexed on one channel each), from 100 humans on
10 projects, with the planner's limits raised for the run (``limits.streams_per_human``,
``server.maximum_concurrent_rpcs``). Then measures, in the same run (T5 of ``python -m
bench``, at this size): the planner's RSS growth per stream, its idle CPU over a window
(and per heartbeat interval with ``--heartbeat-s``, which sets
``planner.stream_heartbeat_s``), the database connections it holds, and one-round turns
on another session with the streams open against the same turns before they were
opened and after they were closed. Writes ``idle.json`` and ``idle.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from pathlib import Path

from bench.context import log
from bench.procs import REPO_ROOT
from bench.report import Report, machine, markdown, write
from bench.runner import QUICK, Bench, Environment, Options
from bench.scale import settings

#: Streams per client connection: the planner's default server.max_concurrent_streams.
PER_CHANNEL = 1000


async def run_idle(options: Options, streams: int, idle_s: float) -> Report:
    """Start the process tree and run the idle-streams phase at ``streams``."""
    report = Report(mode=f"idle {streams}", machine=machine())
    started = time.monotonic()
    sizes = dataclasses.replace(
        QUICK, streams=streams, streams_per_channel=PER_CHANNEL, idle_s=idle_s
    )
    env = await Environment.start(options)
    bench = Bench(env, sizes, report, options)
    try:
        await bench.set_scenario(rounds=1)
        log(f"opening {streams:,} idle streams")
        await bench.idle_streams()
    finally:
        await bench.close()
        env.stop(keep_logs_in=options.out if options.keep else None)
    report.total_s = time.monotonic() - started
    return report


def main(argv: list[str]) -> int:
    """``python -m bench idle``."""
    parser = argparse.ArgumentParser(prog="python -m bench idle", description=__doc__)
    parser.add_argument("--streams", type=int, default=10_000)
    parser.add_argument("--idle-s", type=float, default=30.0, help="idle window, seconds")
    parser.add_argument("--heartbeat-s", type=float, help="planner.stream_heartbeat_s")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--keep", action="store_true", help="keep the logs")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    args = parser.parse_args(argv)
    per_human = -(-args.streams // 100) + 16
    overrides = {
        "limits.streams_per_human": str(per_human),
        "server.maximum_concurrent_rpcs": str(args.streams + 1000),
    }
    if args.heartbeat_s:
        overrides["planner.stream_heartbeat_s"] = f"{args.heartbeat_s:g}"
    overrides.update(dict(settings(args.set, parser)))
    options = Options(
        quick=True,
        out=args.out,
        database_url=None,
        profile=False,
        keep=args.keep,
        planner_settings=tuple(overrides.items()),
    )
    report = asyncio.run(run_idle(options, args.streams, args.idle_s))
    json_path, md_path = write(report, options.out, "idle")
    print(markdown(report))
    log(f"wrote {json_path} and {md_path}")
    return 0
