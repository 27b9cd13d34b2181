"""``python -m bench.retention``: what a retention batch costs (decision 0250).

On PostgreSQL (a throwaway cluster, or ``--database-url`` of a role that may create
databases) and on SQLite, with seeded idle sessions of the size a turn stores (a human
message, an answer of about 1 KiB, a tool call and its result, and their events):

- a batch at the default bounds (100 sessions of 10 turns, 4,000 events in all) through
  ``SqlRetentionStore.delete_sessions`` (lock, re-check, count, delete, notify), against
  a bare ``DELETE ... WHERE session_id IN (...)`` of a same-sized batch (the cascade
  alone) in the same run: the ratio is what the re-checks cost;
- one large session (``--large-turns``, 5,000 turns by default: 40,000 events), which
  is deleted alone in one transaction;
- a window of 1,000 candidates (``idle_window``) against a bare ``SELECT`` of 1,000
  session rows by the same index.

Prints one line per measurement: the median of ``--runs`` runs in milliseconds, and the
ratio to its bare baseline where there is one.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import delete, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from service.adapters.store import make_engine, migrate
from service.adapters.store.retention import SqlRetentionStore
from service.adapters.store.tables import messages, session_events, sessions, turns

LONG_AGO = datetime(2025, 1, 6, tzinfo=UTC)
CUTOFF = LONG_AGO + timedelta(days=30)
ANSWER = "An answer of about a kilobyte, as a turn stores one. " * 20


async def seed(engine: AsyncEngine, prefix: str, count: int, turns_each: int) -> list[str]:
    """``count`` idle sessions of ``turns_each`` turns (8 events, 4 messages a turn)."""
    ids = [f"{prefix}-{index:06d}" for index in range(count)]
    session_rows, turn_rows, message_rows, event_rows = [], [], [], []
    for session_id in ids:
        session_rows.append(
            {
                "session_id": session_id,
                "project_id": "p",
                "organization_id": "o",
                "owner_id": "alice",
                "create_time": LONG_AGO,
                "update_time": LONG_AGO,
                "last_sequence": 8 * turns_each,
            }
        )
        for turn in range(turns_each):
            turn_id = f"{session_id}-t{turn}"
            turn_rows.append(
                {
                    "turn_id": turn_id,
                    "session_id": session_id,
                    "human_id": "alice",
                    "project_id": "p",
                    "state": "ended",
                    "start_time": LONG_AGO,
                    "end_time": LONG_AGO,
                    "request_id": turn_id,
                }
            )
            for step in range(8):
                sequence = 8 * turn + step + 1
                event_rows.append(
                    {
                        "session_id": session_id,
                        "sequence": sequence,
                        "turn_id": turn_id,
                        "kind": "assistant_message",
                        "create_time": LONG_AGO,
                    }
                )
                if step % 2 == 0:
                    message_rows.append(
                        {
                            "session_id": session_id,
                            "sequence": sequence,
                            "message_id": f"{turn_id}-m{step}",
                            "turn_id": turn_id,
                            "kind": "assistant",
                            "create_time": LONG_AGO,
                            "text": ANSWER if step == 6 else "a short message",
                        }
                    )
    async with engine.begin() as conn:
        await conn.execute(insert(sessions), session_rows)
        await conn.execute(insert(turns), turn_rows)
        for chunk in range(0, len(message_rows), 5000):
            await conn.execute(insert(messages), message_rows[chunk : chunk + 5000])
        for chunk in range(0, len(event_rows), 5000):
            await conn.execute(insert(session_events), event_rows[chunk : chunk + 5000])
    return ids


async def bare_delete(engine: AsyncEngine, ids: list[str]) -> None:
    async with engine.begin() as conn:
        await conn.execute(delete(sessions).where(sessions.c.session_id.in_(ids)))


async def bare_window(engine: AsyncEngine) -> None:
    query = (
        select(sessions.c.session_id, sessions.c.update_time, sessions.c.last_sequence)
        .where(sessions.c.update_time < CUTOFF)
        .order_by(sessions.c.update_time, sessions.c.session_id)
        .limit(1000)
    )
    async with engine.connect() as conn:
        (await conn.execute(query)).all()


async def timed(work: Callable[[], Awaitable[object]]) -> float:
    started = time.perf_counter()
    await work()
    return (time.perf_counter() - started) * 1000


async def measure(url: str, runs: int, large_turns: int) -> list[str]:
    await migrate(url)
    engine = make_engine(url)
    store = SqlRetentionStore(engine, "bench")
    lines: list[str] = []
    try:
        ours, bare = [], []
        for run in range(runs):
            mine = await seed(engine, f"ours{run}", 100, 10)
            theirs = await seed(engine, f"bare{run}", 100, 10)
            ours.append(
                await timed(lambda ids=mine: store.delete_sessions(ids, idle_before=CUTOFF))
            )
            bare.append(await timed(lambda ids=theirs: bare_delete(engine, ids)))
        lines.append(_line("batch of 100 sessions, 4,000 events", ours, bare))

        large = []
        for run in range(max(1, runs // 2)):
            (big,) = await seed(engine, f"large{run}", 1, large_turns)
            large.append(await timed(lambda sid=big: store.delete_sessions([sid])))
        lines.append(_line(f"one session of {8 * large_turns:,} events, alone", large, None))

        await seed(engine, "scan", 5000, 1)
        windows, bare_windows = [], []
        for _ in range(runs):
            windows.append(await timed(lambda: store.idle_window(CUTOFF, None, 1000)))
            bare_windows.append(await timed(lambda: bare_window(engine)))
        lines.append(_line("window of 1,000 candidates", windows, bare_windows))
    finally:
        await engine.dispose()
    return lines


def _line(name: str, ours: list[float], bare: list[float] | None) -> str:
    median = statistics.median(ours)
    text = f"{name}: {median:.1f} ms"
    if bare:
        baseline = statistics.median(bare)
        text += f" (bare {baseline:.1f} ms, ratio {median / baseline:.2f})"
    return text


async def main(args: argparse.Namespace) -> None:
    from tests.pg import PgCluster

    with tempfile.TemporaryDirectory() as folder:
        sqlite = f"sqlite+aiosqlite:///{Path(folder) / 'planner.db'}"
        for line in await measure(sqlite, args.runs, args.large_turns):
            print(f"sqlite: {line}")
    if args.database_url:
        urls, cluster = [args.database_url], None
    else:
        cluster = PgCluster.temporary()
        cluster.start()
        name = f"bench_{uuid.uuid4().hex[:8]}"
        cluster.create_database(name)
        urls = [cluster.url(name)]
    try:
        for line in await measure(urls[0], args.runs, args.large_turns):
            print(f"postgresql: {line}")
    finally:
        if cluster is not None:
            cluster.destroy()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.retention", description=__doc__)
    parser.add_argument("--database-url", help="an existing PostgreSQL database to use")
    parser.add_argument("--runs", type=int, default=7, help="runs per measurement (7)")
    parser.add_argument("--large-turns", type=int, default=5000, help="turns of the large one")
    asyncio.run(main(parser.parse_args()))
