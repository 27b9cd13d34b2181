"""The benchmark run: start the process tree, measure every phase, report.

Phases, in order (docs/performance.md; each planner figure is set beside the bare figures
measured in the same run with the same process layout):

1. Bare baselines: grpc.aio unary echo, a new server-streaming call, a ping-pong on an
   open bidirectional stream, a server stream's messages per second, INSERT + COMMIT
   (psycopg, and SQLAlchemy as the store uses it); plus the real dependency calls the
   planner makes (a scripted model call, a tracker ``GetItem``) made directly.
2. T1: what one one-round turn makes (model calls, tool calls, system-prompt RPCs,
   write transactions), counted.
3. T2 and T4 at concurrency 1: one-round turns, and four-round turns for the cost of
   one more round; CPU seconds per turn per process.
4. T4: turns per second at 10 and 100 concurrent sessions, p50 and p99, errors.
5. T3: one-round turns in sessions holding 100, 1,000 and 10,000 messages.
6. T6: time to first delta (through the planner and from the gateway directly), and
   the pass-through rate of a long answer in many deltas.
7. T5: 1,000 idle Chat streams: memory, database connections, idle CPU, and a turn on
   another session.
8. The profile of the per-round path (py-spy on the planner).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.context import (
    HUMANS,
    MACHINE,
    PROJECTS,
    log,
)
from bench.otlp_sink import OtlpSink
from bench.phases.baselines import Baselines
from bench.phases.concurrency import Concurrency
from bench.phases.counts import Counts
from bench.phases.deltas import Deltas
from bench.phases.history import History
from bench.phases.profiling import Profiling
from bench.phases.streams import Streams
from bench.procs import (
    Child,
    PostgresProcesses,
    machine_busy_seconds,
    python_child,
    self_cpu_seconds,
)
from bench.report import Report, machine
from service.adapters.store import migrate
from tests.pg import ExternalPg, PgCluster, PgServer


@dataclass(frozen=True)
class Sizes:
    """How much each phase measures (``FULL`` or ``QUICK``)."""

    bare_runs: int
    unary: int
    new_stream: int
    ping_pong: int
    stream_messages: int
    insert: int
    warmup: int
    turn_runs: int
    turns: int
    rounds: int
    round_turns: int
    window_runs: int
    warmup10_s: float
    window10_s: float
    warmup100_s: float
    window100_s: float
    history_runs: int
    history_turns: int
    ttfd_runs: int
    ttfd: int
    long_deltas: int
    long_runs: int
    streams: int
    idle_base_s: float
    idle_s: float
    idle_turn_runs: int
    idle_turns: int
    profile_s: int
    #: Idle streams per client connection (HTTP/2 streams on one channel).
    streams_per_channel: int = 100


FULL = Sizes(
    bare_runs=5, unary=400, new_stream=300, ping_pong=500, stream_messages=20_000, insert=300,
    warmup=30, turn_runs=5, turns=40, rounds=4, round_turns=12,
    window_runs=3, warmup10_s=1.0, window10_s=3.0, warmup100_s=3.0, window100_s=4.0,
    history_runs=5, history_turns=15,
    ttfd_runs=5, ttfd=20, long_deltas=10_000, long_runs=3,
    streams=1000, idle_base_s=5.0, idle_s=60.0, idle_turn_runs=3, idle_turns=15,
    profile_s=10,
)  # fmt: skip
QUICK = Sizes(
    bare_runs=3, unary=150, new_stream=100, ping_pong=200, stream_messages=5_000, insert=100,
    warmup=15, turn_runs=3, turns=15, rounds=4, round_turns=6,
    window_runs=3, warmup10_s=0.5, window10_s=1.5, warmup100_s=2.0, window100_s=2.0,
    history_runs=3, history_turns=8,
    ttfd_runs=3, ttfd=10, long_deltas=5_000, long_runs=3,
    streams=1000, idle_base_s=5.0, idle_s=10.0, idle_turn_runs=3, idle_turns=8,
    profile_s=5,
)  # fmt: skip


@dataclass(frozen=True)
class Options:
    """Command-line options (``python -m bench --help``)."""

    quick: bool
    out: Path
    database_url: str | None
    profile: bool
    keep: bool
    #: Planner settings to override, ``table.key`` -> value (``--set``), e.g. to measure
    #: a larger ``database.pool_size``.
    planner_settings: tuple[tuple[str, str], ...] = ()
    #: Trace the planner into an OTLP sink in the driver (``--traced``), to measure what
    #: tracing costs a turn (docs/decisions/0190-tracing.md).
    traced: bool = False


def _ready_file(path: Path, child: Child, limit_s: float = 60.0) -> dict[str, object]:
    """What ``serve --ready-file PATH`` wrote once it bound its ports (it was given port 0:
    no port is picked here for it to bind later, decision 0322)."""
    deadline = time.monotonic() + limit_s
    while not path.exists():
        try:
            child.process.wait(0.05)
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{child.name}: no ready file in {limit_s} s") from None
            continue
        raise RuntimeError(f"{child.name} exited before it was ready:\n{child.log_tail()}")
    values: dict[str, object] = json.loads(path.read_text())
    return values


class Environment:
    """The process tree: PostgreSQL, the stack, the planner, the bare server."""

    def __init__(self, work: Path, server: PgServer, cluster: PgCluster | None) -> None:
        self.work = work
        self.server = server
        self.cluster = cluster
        suffix = uuid.uuid4().hex[:8]
        self.planner_db = f"bench_planner_{suffix}"
        self.stack_db = f"bench_devstack_{suffix}"
        self.planner_url = server.url(self.planner_db)
        self.stack_url = server.url(self.stack_db)
        self.children: list[Child] = []
        self.overrides: dict[str, str] = {}
        self.stack: Child | None = None
        self.planner: Child | None = None
        self.bare: Child | None = None
        self.planner_address = ""
        self.stack_address = ""
        self.bare_address = ""
        self.metrics_address = ""
        self.postgres: PostgresProcesses | None = (
            PostgresProcesses(cluster.data_dir) if cluster is not None else None
        )

    @classmethod
    async def start(
        cls, options: Options, cluster_settings: dict[str, str] | None = None
    ) -> Environment:
        """Start the process tree; ``cluster_settings`` (postgresql.conf names and
        values) are added to the throwaway cluster's configuration (e.g. durability on)."""
        work = Path(tempfile.mkdtemp(prefix="ballet-bench-"))
        cluster: PgCluster | None = None
        server: PgServer
        if options.database_url:
            server = ExternalPg(options.database_url)
        else:
            cluster = PgCluster.temporary()
            # Counts the planner's SQL statements per turn (T1); top-level statements
            # only, so a server-side function is one statement, as it is one round trip.
            cluster.configure(
                {"shared_preload_libraries": "'pg_stat_statements'", **(cluster_settings or {})}
            )
            cluster.start()
            server = cluster
        env = cls(work, server, cluster)
        env.overrides = dict(options.planner_settings)
        try:
            await env._start_processes()
        except BaseException:
            env.stop(keep_logs_in=options.out)
            raise
        return env

    async def _start_processes(self) -> None:
        self.server.create_database(self.planner_db)
        self.server.create_database(self.stack_db)
        await migrate(self.planner_url)
        log("starting the dependency stack (devstack + scripted gateway)")
        self.stack = python_child(
            "stack",
            "bench.stack",
            [
                "--data-dir",
                str(self.work),
                "--database-url",
                self.stack_url,
                "--users",
                str(HUMANS),
                "--projects",
                str(PROJECTS),
            ],
            self.work / "stack.log",
        )
        self.children.append(self.stack)
        self.stack_address = str(self.stack.ready["address"])
        log("starting the planner (ballet-planner serve)")
        self.planner = await self.start_planner("planner")
        self.planner_address = str(self.planner.ready["address"])
        self.metrics_address = str(self.planner.ready["metrics_address"])
        self.bare = python_child("bare", "bench.bare", [], self.work / "bare.log")
        self.children.append(self.bare)
        self.bare_address = str(self.bare.ready["address"])

    async def start_planner(self, name: str) -> Child:
        """Start one ``ballet-planner serve`` on this environment's database and stack
        (another replica when one runs already) on port 0, wait until it serves; its child,
        whose ``ready`` holds the bound ``address`` and ``metrics_address``."""
        env = {
            "BALLET_PLANNER__DATA_DIR": str(self.work),
            "BALLET_PLANNER__SERVER__ADDRESS": "127.0.0.1:0",
            "BALLET_PLANNER__SERVER__METRICS_ADDRESS": "127.0.0.1:0",
            "BALLET_PLANNER__SERVER__GRACE_S": "7",
            "BALLET_PLANNER__DATABASE__URL": self.planner_url,
        }
        for dependency in ("TRACKER", "SKILLS", "KNOWLEDGE", "GATEWAY"):
            env[f"BALLET_PLANNER__DEPENDENCIES__{dependency}__ADDRESS"] = self.stack_address
        for key, value in self.overrides.items():
            env["BALLET_PLANNER__" + key.upper().replace(".", "__")] = value
        ready = self.work / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        child = Child(
            name,
            [sys.executable, "-m", "service.cli", "serve", "--ready-file", str(ready)],
            self.work / f"{name}.log",
            env=env,
            wait_line=False,
        )
        self.children.append(child)
        child.ready = await asyncio.to_thread(_ready_file, ready, child)
        await self._wait_serving(child, str(child.ready["address"]))
        return child

    async def _wait_serving(self, child: Child, address: str) -> None:
        # No event to await across processes: poll health, bounded.
        async with grpc.aio.insecure_channel(address) as chan:
            stub = health_pb2_grpc.HealthStub(chan)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if not child.alive():
                    raise RuntimeError(f"the planner exited:\n{child.log_tail()}")
                with contextlib.suppress(grpc.aio.AioRpcError):
                    answer = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if answer.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                await asyncio.sleep(0.1)
        raise RuntimeError(f"the planner did not serve within 60 s:\n{child.log_tail()}")

    def cpu_sources(self) -> dict[str, Callable[[], float]]:
        assert self.planner is not None and self.stack is not None
        sources: dict[str, Callable[[], float]] = {
            "planner": self.planner.cpu_seconds,
            "stack": self.stack.cpu_seconds,
        }
        if self.postgres is not None:
            sources["postgres"] = self.postgres.cpu_seconds
        sources["driver"] = self_cpu_seconds
        # Not one of ours: the whole machine, to tell what other work took (MACHINE).
        sources[MACHINE] = machine_busy_seconds
        return sources

    def stop(self, *, keep_logs_in: Path | None = None, keep: bool = False) -> None:
        for child in reversed(self.children):
            child.stop()
        if keep_logs_in is not None:
            keep_logs_in.mkdir(parents=True, exist_ok=True)
            for name in ("planner.log", "stack.log", "bare.log"):
                with contextlib.suppress(OSError):
                    shutil.copy(self.work / name, keep_logs_in / name)
        for name in (self.planner_db, self.stack_db):
            with contextlib.suppress(Exception):
                self.server.drop_database(name)
        if self.cluster is not None:
            self.cluster.destroy()
        if not keep:
            shutil.rmtree(self.work, ignore_errors=True)


class Bench(Baselines, Counts, Concurrency, History, Deltas, Streams, Profiling):
    """One run of every phase (``bench/phases/``) over one shared context; ``report``
    collects the rows."""


async def _phase(report: Report, name: str, work: Awaitable[Any]) -> Any:
    log(name)
    started = time.monotonic()
    try:
        return await work
    finally:
        report.phases_s[name] = time.monotonic() - started


async def run(options: Options) -> Report:
    """Run every phase; returns the report (also written to ``options.out``)."""
    sizes = QUICK if options.quick else FULL
    report = Report(mode="quick" if options.quick else "full", machine=machine())
    started = time.monotonic()
    sink = None
    if options.traced:
        # The children inherit the driver's environment (procs.Child): OTEL_* set here
        # traces the planner (the stack, bench.stack, installs no tracing).
        sink = OtlpSink()
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink.start()
        os.environ["OTEL_EXPORTER_OTLP_INSECURE"] = "true"
    log("starting PostgreSQL and the process tree")
    env = await Environment.start(options)
    bench = Bench(env, sizes, report, options)
    failed = True
    try:
        await _phase(report, "bare baselines", bench.bare_baselines())
        stream = await _phase(report, "T1, T2, CPU at 1", bench.concurrency_one())
        await _phase(report, "T4 at 10", bench.concurrency(10, sizes.warmup10_s, sizes.window10_s))
        await _phase(
            report, "T4 at 100", bench.concurrency(100, sizes.warmup100_s, sizes.window100_s)
        )
        await _phase(report, "T3 history", bench.history())
        await _phase(report, "T6 deltas", bench.deltas())
        await _phase(report, "T5 idle streams", bench.idle_streams())
        await _phase(report, "stream limit", bench.probe_stream_limit())
        if options.profile:
            await _phase(report, "profile", bench.profile(stream))
        stream.cancel()
        assert env.planner is not None
        report.notes.append(f"Planner RSS at the end: {env.planner.rss_bytes() / 2**20:.0f} MiB.")
        failed = False
    finally:
        await bench.close()
        env.stop(keep_logs_in=options.out if failed or options.keep else None, keep=options.keep)
        if sink is not None:
            sink.stop()
            report.notes.append(
                f"Traced (--traced): the planner exported {sink.spans:,} spans "
                f"in {sink.batches:,} batches to an OTLP sink in the driver."
            )
    report.total_s = time.monotonic() - started
    return report
