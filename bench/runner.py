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
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import database, profile
from bench.bare import MESSAGE_BYTES, BareClient
from bench.client import ChatError, ChatStream, Dependencies, Tokens, TurnResult, channel
from bench.otlp_sink import OtlpSink
from bench.procs import (
    Child,
    CpuMeter,
    PostgresProcesses,
    machine_busy_seconds,
    python_child,
    self_cpu_seconds,
)
from bench.report import Report, Row, compare, judge, machine, time_row
from bench.scenarios import ITEM_ID, scenario
from bench.stack import CONTROL, human_id, project_ids
from bench.stats import Repeated, percentile, repeated_medians, repeated_values
from service.adapters.store import migrate
from tests.pg import ExternalPg, PgCluster, PgServer

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


def log(message: str) -> None:
    """Progress on stderr (the table goes to stdout)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


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
        bench: Bench,
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
class _Load:
    """What a steady load saw: completions ``(monotonic end, latency s)``, errors, end
    reasons, CPU marks ``(monotonic, seconds by process)`` at window edges, and the most
    database connections of the planner seen."""

    completions: list[tuple[float, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)
    marks: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    connections: int = 0


class Bench:
    """One run of every phase; ``report`` collects the rows."""

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

    # ------------------------------------------------------------------ 2. T1

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

    # ------------------------------------------------------------------ 3. T2, T4 at 1

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

    # ------------------------------------------------------------------ 4. T4

    async def _steady_load(
        self, streams: list[Rotating], warmup_s: float, windows: int, window_s: float
    ) -> _Load:
        """Every stream runs one-round turns back to back for ``warmup_s`` plus
        ``windows`` x ``window_s`` seconds; completions and CPU are read per window.

        Windows are cut by time, not by turns: at 100 sessions a turn lasts longer than
        a short window, so a turn counts in the window where it completes.
        """
        load = _Load()
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

    # ------------------------------------------------------------------ 5. T3

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

    # ------------------------------------------------------------------ 6. T6

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

    # ------------------------------------------------------------------ 7. T5

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

    # ------------------------------------------------------------------ 8. profile

    async def profile(self, stream: Rotating) -> None:
        env = self.env
        assert env.planner is not None
        if profile.find_py_spy() is None:
            self.report.notes.append(
                "Profile skipped: py-spy is not installed (pip install py-spy)."
            )
            return
        output = env.work / "profile.txt"
        recorder = profile.start_recording(env.planner.pid, self.sizes.profile_s, output)
        turns = 0
        while recorder.poll() is None:
            await self.turns(stream, 1)
            turns += 1
        stderr = recorder.stderr.read().decode(errors="replace") if recorder.stderr else ""
        if recorder.returncode != 0 or not output.exists():
            self.report.notes.append(
                f"Profile failed (py-spy exit {recorder.returncode}): {stderr[-300:]}"
            )
            return
        found = profile.analyse(output.read_text())
        self.report.profile = {
            "turns": turns,
            "samples": found.samples,
            "components": found.components,
            "planner_functions": found.planner_functions,
            "inclusive": found.inclusive,
        }
        if self.options.out:
            self.options.out.mkdir(parents=True, exist_ok=True)
            shutil.copy(output, self.options.out / "profile-collapsed.txt")


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
