"""PostgreSQL for the benchmark: the bare INSERT + COMMIT, counters, and seeded
transcripts.

- ``insert_commit``: the bare cost of one small INSERT and its COMMIT, over psycopg 3
  directly (the floor) and through SQLAlchemy's async engine as the planner's store
  uses it (``make_engine``), on the planner's own database.
- ``write_transactions``: PostgreSQL gives a transaction an xid only when it writes, so
  the advance of ``pg_current_snapshot()``'s xmax counts write transactions (commits
  that changed something) without counting reads, and reading it assigns none.
- ``seed_transcript``: stores N messages of earlier turns in a session with direct SQL
  (the store's own row codec), and a summary that covers all but the last 20 (T3).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from datetime import UTC, datetime, timedelta

import psycopg
from sqlalchemy import insert, text, update

from service.adapters.store import codec, make_engine
from service.adapters.store.tables import messages, session_events, sessions
from service.core.estimate import message_tokens
from service.core.model import EventKind, Message, MessageKind, SessionEvent, Usage

_BARE_TABLE = "bench_bare_insert"


def libpq_url(sqlalchemy_url: str) -> str:
    """``postgresql+psycopg://...`` as the libpq URL psycopg takes."""
    return sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://", 1)


async def insert_commit_psycopg(url: str, runs: int, per_run: int) -> list[list[float]]:
    """``runs`` batches of ``per_run`` INSERT + COMMIT, psycopg directly; seconds each."""
    batches: list[list[float]] = []
    async with await psycopg.AsyncConnection.connect(libpq_url(url)) as conn:
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {_BARE_TABLE} "
            "(id bigserial PRIMARY KEY, session_id text NOT NULL, body text NOT NULL)"
        )
        await conn.commit()
        for _ in range(runs):
            batch = []
            for _ in range(per_run):
                started = time.perf_counter()
                await conn.execute(
                    f"INSERT INTO {_BARE_TABLE} (session_id, body) VALUES (%s, %s)",
                    ("session", "a small row like an event"),
                )
                await conn.commit()
                batch.append(time.perf_counter() - started)
            batches.append(batch)
        await conn.execute(f"DROP TABLE {_BARE_TABLE}")
        await conn.commit()
    return batches


async def insert_commit_sqlalchemy(url: str, runs: int, per_run: int) -> list[list[float]]:
    """The same through ``make_engine`` and ``engine.begin()``, as the store writes."""
    engine = make_engine(url, pool_size=1)
    batches: list[list[float]] = []
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    f"CREATE TABLE IF NOT EXISTS {_BARE_TABLE} "
                    "(id bigserial PRIMARY KEY, session_id text NOT NULL, body text NOT NULL)"
                )
            )
        statement = text(f"INSERT INTO {_BARE_TABLE} (session_id, body) VALUES (:s, :b)")
        for _ in range(runs):
            batch = []
            for _ in range(per_run):
                started = time.perf_counter()
                async with engine.begin() as conn:
                    await conn.execute(statement, {"s": "session", "b": "a small row"})
                batch.append(time.perf_counter() - started)
            batches.append(batch)
        async with engine.begin() as conn:
            await conn.execute(text(f"DROP TABLE {_BARE_TABLE}"))
    finally:
        await engine.dispose()
    return batches


class ServerProbe:
    """One autocommit connection for reading counters of the PostgreSQL server."""

    def __init__(self, conn: psycopg.AsyncConnection[tuple[object, ...]]) -> None:
        self._conn = conn

    @classmethod
    async def connect(cls, url: str) -> ServerProbe:
        conn = await psycopg.AsyncConnection.connect(libpq_url(url), autocommit=True)
        return cls(conn)

    async def close(self) -> None:
        await self._conn.close()

    async def next_xid(self) -> int:
        """The next transaction id to be assigned (counts write transactions)."""
        row = await (
            await self._conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text")
        ).fetchone()
        assert row is not None
        return int(str(row[0]))

    async def statements(self) -> int:
        """SQL statements run so far in this probe's database by other sessions (the
        planner), counted by ``pg_stat_statements`` at top level; -1 when the extension
        is not loaded (an existing server given with ``--database-url``)."""
        try:
            await self._conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            row = await (
                await self._conn.execute(
                    "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements"
                    " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
                    " AND query NOT LIKE %s AND query NOT LIKE %s AND query NOT LIKE %s"
                    " AND query NOT LIKE %s AND query NOT LIKE %s",
                    (
                        "%pg_stat_statements%",
                        "%pg_current_snapshot%",
                        "%pg_stat_activity%",
                        "%count(*) FROM session_follows%",
                    ),
                )
            ).fetchone()
        except psycopg.Error:
            return -1
        assert row is not None
        return int(str(row[0]))

    async def notifies(self) -> int:
        """``pg_notify`` statements run so far in this database (``pg_stat_statements``;
        -1 when the extension is not loaded)."""
        try:
            row = await (
                await self._conn.execute(
                    "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements"
                    " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
                    " AND query LIKE %s",
                    ("%pg_notify%",),
                )
            ).fetchone()
        except psycopg.Error:
            return -1
        assert row is not None
        return int(str(row[0]))

    async def follows(self, session_id: str) -> int:
        """Replicas recorded as following ``session_id`` (``session_follows``)."""
        row = await (
            await self._conn.execute(
                "SELECT count(*) FROM session_follows WHERE session_id = %s", (session_id,)
            )
        ).fetchone()
        assert row is not None
        return int(str(row[0]))

    async def connections(self, application_name: str) -> int:
        """Connections of one application (e.g. ``ballet-planner``) to the server."""
        row = await (
            await self._conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                (application_name,),
            )
        ).fetchone()
        assert row is not None
        return int(str(row[0]))


# --------------------------------------------------------------------------- T3 seeding

_HUMAN = "What is the state of PAN-9, and what blocks the shopping list epic this week?"
_ARGS = '{"item_id":"PAN-9"}'
_RESULT = (
    '{"item":{"item_id":"PAN-9","kind":"ticket","title":"Session expires after 5 minutes '
    'instead of 12 hours","state":"open","priority":0,"ticket_type":"bug","epic_id":"PAN-3",'
    '"milestone_id":"PAN-1","description":"'
    + "Users are logged out while cooking. " * 30
    + '","acceptance_criteria":"- A session lasts 12 hours","blocked_by_ids":[],"blocks_ids":[]}}'
)
_ANSWER = "PAN-9 is open and has the highest priority. " * 6
#: Messages the summary leaves out (docs/performance.md, T3: "a summary covering all but the last
#: 20").
KEPT = 20


def _seed_message(
    step: int, session_id: str, turn_id: str, call_id: str, sequence: int, when: datetime
) -> tuple[EventKind, Message]:
    message_id = f"msg_{uuid.uuid4().hex}"
    common = (session_id, turn_id, message_id)
    if step == 0:
        return EventKind.MESSAGE_ACCEPTED, Message(
            *common, MessageKind.HUMAN, when, sequence, text=_HUMAN
        )
    if step == 1:
        return EventKind.TOOL_CALL_STARTED, Message(
            *common,
            MessageKind.TOOL_CALL,
            when,
            sequence,
            tool_call_id=call_id,
            tool_name="get_item",
            tool_arguments=_ARGS,
        )
    if step == 2:
        return EventKind.TOOL_CALL_FINISHED, Message(
            *common,
            MessageKind.TOOL_RESULT,
            when,
            sequence,
            tool_call_id=call_id,
            tool_name="get_item",
            tool_result=_RESULT,
        )
    return EventKind.ASSISTANT_MESSAGE, Message(
        *common,
        MessageKind.ASSISTANT,
        when,
        sequence,
        text=_ANSWER,
        usage=Usage(input_tokens=1200, output_tokens=40),
    )


async def seed_transcript(
    url: str, session_id: str, human_id: str, count: int, kept: int = KEPT
) -> int:
    """Store ``count`` messages (``count`` and ``kept`` divisible by 4: turns of human,
    tool call, tool result, answer) in an empty session, with a summary up to all but
    the last ``kept``; returns the session's new last sequence (= ``count``)."""
    if count % 4 or kept % 4 or count < kept:
        raise ValueError("count and kept must be multiples of 4, count at least kept")
    start = datetime.now(UTC) - timedelta(days=30)
    message_rows = []
    event_rows = []
    kept_tokens = 0
    for index in range(count):
        sequence = index + 1
        # One turn id per group of four, as a real turn stores them.
        turn_id = f"turn_seed_{session_id[-12:]}_{index // 4:06d}"
        call_id = f"call_seed_{index // 4:08d}"
        when = start + timedelta(seconds=index)
        kind, message = _seed_message(index % 4, session_id, turn_id, call_id, sequence, when)
        message = dataclasses.replace(message, human_id=human_id)
        if index >= count - kept:
            kept_tokens += message_tokens(message)
        message_rows.append(codec.message_row(message))
        event_rows.append(
            codec.event_row(SessionEvent(session_id, turn_id, kind, when, sequence, message))
        )
    engine = make_engine(url, pool_size=1)
    try:
        async with engine.begin() as conn:
            for offset in range(0, count, 2000):
                await conn.execute(insert(messages), message_rows[offset : offset + 2000])
                await conn.execute(insert(session_events), event_rows[offset : offset + 2000])
            await conn.execute(
                update(sessions)
                .where(sessions.c.session_id == session_id)
                .values(
                    last_sequence=count,
                    summary="The human asked about PAN-9 many times; it is open. " * 10,
                    summary_up_to=count - kept,
                    context_base_tokens=1240,
                    context_pending_tokens=kept_tokens,
                )
            )
            # Autovacuum would analyze tables this size soon after; do it now so the
            # plans are the steady state's.
            await conn.execute(text("ANALYZE messages"))
            await conn.execute(text("ANALYZE session_events"))
    finally:
        await engine.dispose()
    return count
