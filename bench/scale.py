"""``python -m bench scale``: several planner replicas on one durable PostgreSQL.

What the deployment's turn rate is when replicas share one cluster, and what one stalled
``NOTIFY`` elsewhere in the cluster does to it:

1. The ceiling of the cluster itself (``pgbench``, when installed): commits per second
   of a one-row INSERT at 8, 32 and 64 clients, plain, with ``pg_notify`` in the same
   transaction, and with ``pg_notify`` in its own transaction after the commit.
2. For each replica count (default 2, then 4: replicas are added to the running ones),
   64 sessions (Chat streams spread round-robin over the replicas) run one-round turns
   back to back: turns/s, commits/s of the planner's database (``pg_stat_database``
   ``xact_commit``), write transactions/s of the cluster (xid advance), p50 and p99.
3. The same while another connection holds a ``NOTIFY``ing commit: the cluster names a
   synchronous standby that does not exist, every connection commits with
   ``synchronous_commit = local`` (a local WAL flush, as ``on`` is without standbys),
   and the staller's transaction alone sets ``synchronous_commit = remote_apply``, so
   its commit waits for ever while it holds the cluster's notification lock. Before the
   window, a bare ``pg_notify`` is checked to block and a plain commit to go through.

The cluster runs with fsync, synchronous_commit and full_page_writes on. Everything runs
on this machine, so replicas compete with PostgreSQL, the stack and the driver for the
cores: compare figures of one run, not across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psycopg

from bench import database
from bench.client import ChatError, channel
from bench.context import PROJECTS, Rotating, log
from bench.procs import REPO_ROOT, Child
from bench.report import Report, Row, machine, markdown, write
from bench.runner import (
    QUICK,
    Bench,
    Environment,
    Options,
)
from bench.stack import human_id, project_ids
from bench.stats import percentile
from tests.pg import find_pg_bin

#: The cluster's durability, as production runs it (the tests turn all three off).
DURABLE = {
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    # Four replicas' pools (hot path, SQLAlchemy pool and overflow, LISTEN) and pgbench.
    "max_connections": "400",
}
#: The standby the stall waits for; no such standby ever connects.
GHOST_STANDBY = "bench_ghost_standby"
STALL_CHANNEL = "bench_stall"
STALL_TABLE = "bench_stall"
CEILING_TABLE = "bench_ceiling"
CEILING_SCRIPTS = {
    "plain": "INSERT INTO bench_ceiling (v) VALUES (1);\n",
    "notify in the commit": (
        "BEGIN;\nINSERT INTO bench_ceiling (v) VALUES (1);\n"
        "SELECT pg_notify('bench_ceiling', 'x');\nCOMMIT;\n"
    ),
    "notify after the commit": (
        "INSERT INTO bench_ceiling (v) VALUES (1);\nSELECT pg_notify('bench_ceiling', 'x');\n"
    ),
}


@dataclass(frozen=True)
class ScaleOptions:
    """``python -m bench scale`` options (see ``bench.__main__``)."""

    replicas: tuple[int, ...] = (2, 4)
    sessions: int = 64
    warmup_s: float = 3.0
    window_s: float = 10.0
    stall: bool = True
    pgbench_clients: tuple[int, ...] = (8, 32, 64)
    pgbench_s: float = 5.0
    base: Options = field(
        default_factory=lambda: Options(
            quick=True, out=Path("bench/results"), database_url=None, profile=False, keep=False
        )
    )


@dataclass
class _Window:
    """One measured window: turns (start, end, latency s) and counter deltas."""

    turns: list[tuple[float, float, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    start: float = 0.0
    end: float = 0.0
    commits: int = 0
    writes: int = 0
    #: /proc/loadavg's 1-minute figure at the end of the window.
    load: str = ""


def _load_average() -> str:
    """The 1-minute load average (``/proc/loadavg``): other engineers share the machine."""
    with open("/proc/loadavg") as file:
        return file.read().split()[0]


async def _commits(probe: psycopg.AsyncConnection[tuple[object, ...]], dbname: str) -> int:
    row = await (
        await probe.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (dbname,)
        )
    ).fetchone()
    assert row is not None
    return int(str(row[0]))


async def _next_xid(probe: psycopg.AsyncConnection[tuple[object, ...]]) -> int:
    row = await (
        await probe.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text")
    ).fetchone()
    assert row is not None
    return int(str(row[0]))


class Stall:
    """A ``NOTIFY``ing commit held on a synchronous standby that never comes."""

    def __init__(self, url: str) -> None:
        self._url = database.libpq_url(url)
        self._task: asyncio.Task[None] | None = None
        self.check = ""

    async def _admin(self, *statements: str) -> None:
        async with await psycopg.AsyncConnection.connect(self._url, autocommit=True) as conn:
            for statement in statements:
                await conn.execute(statement)

    async def _hold(self) -> None:
        async with await psycopg.AsyncConnection.connect(self._url) as conn:
            await conn.execute("SET LOCAL synchronous_commit = remote_apply")
            # Only a commit that wrote WAL waits for the standby; a bare NOTIFY does not.
            await conn.execute(f"INSERT INTO {STALL_TABLE} VALUES (1)")
            await conn.execute("SELECT pg_notify(%s, 'x')", (STALL_CHANNEL,))
            await conn.commit()

    async def start(self) -> None:
        """Name the ghost standby, start the held commit, check that it stalls NOTIFY."""
        await self._admin(
            f"CREATE TABLE IF NOT EXISTS {STALL_TABLE} (v int)",
            "ALTER SYSTEM SET synchronous_commit = 'local'",
            f"ALTER SYSTEM SET synchronous_standby_names = '{GHOST_STANDBY}'",
            "SELECT pg_reload_conf()",
        )
        await asyncio.sleep(0.5)
        self._task = asyncio.get_running_loop().create_task(self._hold())
        await asyncio.sleep(0.5)
        if self._task.done():
            self._task.result()
            raise RuntimeError("the NOTIFYing commit did not wait for the ghost standby")
        self.check = await self._verify()

    async def _verify(self) -> str:
        async with await psycopg.AsyncConnection.connect(self._url, autocommit=True) as conn:
            started = time.perf_counter()
            await conn.execute(f"INSERT INTO {STALL_TABLE} VALUES (2)")
            plain_ms = (time.perf_counter() - started) * 1000
            notify = await psycopg.AsyncConnection.connect(self._url, autocommit=True)
            try:
                async with asyncio.timeout(2.0):
                    await notify.execute("SELECT pg_notify('bench_probe', 'x')")
                raise RuntimeError("a bare pg_notify went through while the stall was held")
            except TimeoutError:
                pass
            finally:
                pid = notify.info.backend_pid
                await conn.execute("SELECT pg_cancel_backend(%s)", (pid,))
                with contextlib.suppress(psycopg.Error):
                    await notify.close()
        return (
            f"checked: a plain INSERT + COMMIT took {plain_ms:.1f} ms, a bare pg_notify was "
            "still blocked after 2 s"
        )

    async def release(self) -> None:
        """Forget the ghost standby: the held commit completes, and so does any waiter."""
        await self._admin(
            "ALTER SYSTEM RESET synchronous_standby_names",
            "ALTER SYSTEM RESET synchronous_commit",
            "SELECT pg_reload_conf()",
        )
        if self._task is not None:
            async with asyncio.timeout(30):
                await self._task


def ceiling(env: Environment, options: ScaleOptions) -> list[Row]:
    """pgbench on a database of its own in the same cluster; rows of commits/s."""
    pgbench = find_pg_bin("pgbench")
    cluster = env.cluster
    if pgbench is None or cluster is None:
        return []
    dbname = "bench_ceiling"
    env.server.create_database(dbname)
    url = env.server.url(dbname)
    rows = []
    try:
        with psycopg.connect(database.libpq_url(url), autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {CEILING_TABLE} (id bigserial PRIMARY KEY, v int)")
        for name, script in CEILING_SCRIPTS.items():
            path = env.work / f"ceiling-{name.replace(' ', '-')}.sql"
            path.write_text(script)
            for clients in options.pgbench_clients:
                result = subprocess.run(
                    [
                        str(pgbench),
                        "-n",
                        "-M",
                        "prepared",
                        "-c",
                        str(clients),
                        "-j",
                        "2",
                        "-T",
                        f"{options.pgbench_s:g}",
                        "-f",
                        str(path),
                        "-h",
                        "127.0.0.1",
                        "-p",
                        str(cluster.port),
                        "-U",
                        "postgres",
                        dbname,
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                found = re.search(r"tps = ([0-9.]+) \(without initial", result.stdout)
                if found is None:
                    raise RuntimeError(f"pgbench printed no tps:\n{result.stdout}")
                rows.append(
                    Row(
                        "pgbench ceiling (fsync on, one table)",
                        f"ceiling.{name.replace(' ', '_')}.{clients}",
                        f"{name}, {clients} clients",
                        "units/s",
                        float(found.group(1)),
                        samples=f"{options.pgbench_s:g} s",
                    )
                )
                log(f"pgbench {name} at {clients}: {found.group(1)} units/s")
    finally:
        with contextlib.suppress(Exception):
            env.server.drop_database(dbname)
    return rows


async def _load(
    bench: Bench,
    streams: list[Rotating],
    options: ScaleOptions,
    stall: Stall | None,
) -> _Window:
    """Turns back to back on every stream: a warm-up, then one window (held stall in
    it, when given); turns started in the window are waited for after it."""
    window = _Window()
    env = bench.env
    probe = await psycopg.AsyncConnection.connect(
        database.libpq_url(env.planner_url), autocommit=True
    )
    stop = asyncio.Event()

    async def worker(stream: Rotating) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                result = await stream.turn("round")
            except ChatError as error:
                window.errors.append(str(error))
                return
            window.reasons[result.reason] = window.reasons.get(result.reason, 0) + 1
            window.turns.append((started, time.monotonic(), result.latency_s))

    workers = [asyncio.get_running_loop().create_task(worker(s)) for s in streams]
    try:
        await asyncio.sleep(options.warmup_s)
        if stall is not None:
            await stall.start()
        commits0 = await _commits(probe, env.planner_db)
        xid0 = await _next_xid(probe)
        window.start = time.monotonic()
        await asyncio.sleep(options.window_s)
        window.end = time.monotonic()
        # Stats reach pg_stat_database when a backend goes idle, at most a second late.
        window.commits = await _commits(probe, env.planner_db) - commits0
        window.writes = await _next_xid(probe) - xid0
        window.load = _load_average()
        stop.set()
        if stall is not None:
            await stall.release()
        async with asyncio.timeout(90):
            await asyncio.gather(*workers)
    finally:
        stop.set()
        for task in workers:
            task.cancel()
        await probe.close()
    return window


def _rows(label: str, key: str, window: _Window, stall: Stall | None) -> list[Row]:
    span = window.end - window.start
    done = [lat for _, end, lat in window.turns if window.start < end <= window.end]
    # Turns in flight at any time of the window: a turn held by a stall from before the
    # window started counts too.
    started = [lat for start, end, lat in window.turns if start < window.end and end > window.start]
    section = f"{label}{', NOTIFY stalled in the cluster' if stall else ''}"
    failed = [reason for reason in window.reasons if reason != "TURN_END_REASON_COMPLETED"]
    bad = sum(window.reasons[reason] for reason in failed)
    rows = [
        Row(section, f"{key}.rate", "turns/s completed in the window", "turns/s", len(done) / span,
            samples=f"{span:.0f} s ({len(done)} turns)", note=f"load average {window.load}"),
        Row(section, f"{key}.commits", "commits/s, planner database (xact_commit)", "commits/s",
            window.commits / span, samples=f"{span:.0f} s",
            note=f"{window.commits / max(1, len(done)):.1f} per completed turn"),
        Row(section, f"{key}.writes", "write transactions/s, whole cluster (xid advance)",
            "xacts/s", window.writes / span, samples=f"{span:.0f} s"),
    ]  # fmt: skip
    if done:
        rows.append(
            Row(section, f"{key}.p50", "turn latency p50, turns completed in the window", "ms",
                statistics.median(done) * 1000, samples=str(len(done))),
        )  # fmt: skip
    if started:
        rows.append(
            Row(section, f"{key}.p99", "turn latency p99, turns in flight in the window", "ms",
                percentile(started, 99) * 1000, samples=str(len(started)),
                note=f"longest {max(started) * 1000:.0f} ms"
                + ("; held turns complete after the stall ends" if stall else "")),
        )  # fmt: skip
    rows.append(
        Row(section, f"{key}.errors", "errors, and turns that did not complete", "count",
            len(window.errors) + bad, samples=str(len(window.turns)),
            note="; ".join(sorted({*window.errors, *failed}))[:200]),
    )  # fmt: skip
    return rows


async def run_scale(options: ScaleOptions) -> Report:
    """The whole scale run (see the module docstring)."""
    report = Report(mode="scale", machine=machine())
    started = time.monotonic()
    log("starting durable PostgreSQL and the stack")
    env = await Environment.start(options.base, cluster_settings=DURABLE)
    bench = Bench(env, QUICK, report, options.base)
    replicas: list[tuple[Child, str]] = [(env.planner, env.planner_address)]  # type: ignore[list-item]
    chans: list[grpc.aio.Channel] = []
    try:
        for row in ceiling(env, options):
            report.add(row)
        await bench.set_scenario(rounds=1)
        projects = project_ids(PROJECTS)
        for count in options.replicas:
            while len(replicas) < count:
                name = f"planner{len(replicas) + 1}"
                log(f"starting replica {name}")
                child = await env.start_planner(name)
                replicas.append((child, str(child.ready["address"])))
            for chan in chans:
                await chan.close()
            chans = [channel(address) for _, address in replicas[:count]]
            streams = [
                Rotating(bench, human_id(i % 100), projects[i % PROJECTS], chan=chans[i % count])
                for i in range(options.sessions)
            ]
            await asyncio.gather(*(stream.fresh() for stream in streams))
            label = f"{count} replicas, {options.sessions} sessions"
            key = f"scale{count}"
            log(f"{label}: load")
            window = await _load(bench, streams, options, None)
            for row in _rows(label, key, window, None):
                report.add(row)
            if options.stall:
                log(f"{label}: load with a stalled NOTIFY")
                stall = Stall(env.server.admin_url())
                window = await _load(bench, streams, options, stall)
                for row in _rows(label, f"{key}.stalled", window, stall):
                    report.add(row)
                report.notes.append(f"Stall at {count} replicas {stall.check}.")
            for stream in streams:
                stream.cancel()
        report.notes.append(
            "Cluster: fsync, synchronous_commit and full_page_writes on; during a stall "
            "window every connection commits with synchronous_commit = local (the same "
            "local WAL flush; no standby exists) and the staller's remote_apply commit waits."
        )
    finally:
        for chan in chans:
            await chan.close()
        await bench.close()
        env.stop(keep_logs_in=options.base.out if options.base.keep else None)
    report.total_s = time.monotonic() - started
    return report


def _numbers(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def settings(items: list[str], parser: argparse.ArgumentParser) -> tuple[tuple[str, str], ...]:
    """``--set TABLE.KEY=VALUE`` items as pairs; exits with a usage error otherwise."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            parser.error(f"--set {item}: expected TABLE.KEY=VALUE")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def main(argv: list[str]) -> int:
    """``python -m bench scale``; writes ``scale.json`` and ``scale.md`` to ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m bench scale", description=__doc__)
    parser.add_argument("--replicas", default="2,4", help="replica counts, ascending")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--no-stall", action="store_true", help="skip the stalled windows")
    parser.add_argument("--pgbench-clients", default="8,32,64", help="empty: no pgbench")
    parser.add_argument("--pgbench-s", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--keep", action="store_true", help="keep the logs")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    args = parser.parse_args(argv)
    options = ScaleOptions(
        replicas=_numbers(args.replicas),
        sessions=args.sessions,
        warmup_s=args.warmup_s,
        window_s=args.window_s,
        stall=not args.no_stall,
        pgbench_clients=_numbers(args.pgbench_clients),
        pgbench_s=args.pgbench_s,
        base=Options(
            quick=True,
            out=args.out,
            database_url=None,
            profile=False,
            keep=args.keep,
            planner_settings=settings(args.set, parser),
        ),
    )
    report = asyncio.run(run_scale(options))
    json_path, md_path = write(report, options.base.out, "scale")
    print(markdown(report))
    log(f"wrote {json_path} and {md_path}")
    return 0
