"""The store's statement budget (docs/performance.md, T1/T2), counted on both databases.

A one-round turn makes four commits (start_turn; the assistant message with its tool
call; the tool result; the final answer with the turn's end). Statements counted here
are what reaches the database cursor, except SQLite's ``BEGIN IMMEDIATE``; on
PostgreSQL psycopg adds BEGIN and COMMIT to every write, on SQLite COMMIT. The
cross-replica signal a write hands on after its commit (PostgreSQL) is sent by a task of
its own, outside the unit of work, in one autocommit statement for every signal pending
then: it is not counted. A store that signals (PostgreSQL) also reads, in the
transaction of each write of events, whether another replica follows the session
(``session_follows``, decision 0340; the hot path folds that read into its one
statement): one statement more there, counted as ``FOLLOWS``.

=====================================  ==========  =========================================
unit of work                            statements  what
=====================================  ==========  =========================================
start_turn                              6           UPDATE sessions (lock, number);
                                                    SELECT running turn / request-id twin;
                                                    SELECT running-turn counts; INSERT turns;
                                                    INSERT messages; INSERT session_events
commit: assistant message + tool call   4           UPDATE sessions; UPDATE turns (conditions
                                                    in WHERE, patch); INSERT messages;
                                                    INSERT session_events
commit: tool result                     4           (same)
commit: final answer + turn end         4           (same; turn_ended has no message row)
commit: turn end alone                  3           UPDATE sessions; UPDATE turns;
                                                    INSERT session_events
renew_lease, request_cancel, get_turn   1
events_after, list_messages             1
load_context                            2           SELECT session; SELECT messages after
                                                    the summary
=====================================  ==========  =========================================
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from service.adapters.store import SqlSessionStore
from service.adapters.store.signals import notify_sql
from service.core.model import EventKind, MessageKind, SessionEvent, TurnEndReason, Usage
from service.core.ports import TurnCommit, TurnPatch
from tests.integration.conftest import DATABASES, HOT
from tests.integration.store_support import (
    LEASE,
    REPLICA,
    T0,
    end_commit,
    message,
    new_session,
    tool_round_events,
    turn_start,
)


@pytest.fixture(params=[p for p in DATABASES if p.values[0] != HOT])
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """This module's databases: the SQLAlchemy path only (it pins what SQLAlchemy sends,
    or the schema, which the hot path does not change)."""
    if request.param == "postgresql":
        url: str = request.getfixturevalue("pg_url")
        return url
    return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('sqlite') / 'planner.db'}"


#: The read of who else follows the session, in a signalling store's writes of events.
FOLLOWS = 1
#: How the statement that sends signals begins (``signals.notify_sql``).
SIGNALS = notify_sql(1).split(",")[0]


class StatementLog:
    """The SQL statements an engine sends, minus SQLite's BEGIN IMMEDIATE."""

    def __init__(self) -> None:
        self.statements: list[str] = []

    def __call__(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.strip().upper().startswith("BEGIN") or statement.startswith(SIGNALS):
            return
        self.statements.append(" ".join(statement.split())[:60])


@contextmanager
def counting(engine: AsyncEngine) -> Iterator[StatementLog]:
    log = StatementLog()
    event.listen(engine.sync_engine, "before_cursor_execute", log)
    try:
        yield log
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", log)


async def test_a_one_round_turn_stays_within_the_statement_budget(
    store: SqlSessionStore, engine: AsyncEngine
) -> None:
    await store.create_session(new_session("s1"))
    assistant, call, result = tool_round_events("s1", "t1")
    final = SessionEvent(
        "s1",
        "t1",
        EventKind.ASSISTANT_MESSAGE,
        T0,
        message=message("s1", "t1", MessageKind.ASSISTANT, text="T-1 is runnable."),
    )

    follows = FOLLOWS if store.signals is not None else 0
    with counting(engine) as log:
        await store.start_turn(turn_start("s1", "t1"))
    assert len(log.statements) == 6 + follows, log.statements

    with counting(engine) as log:
        await store.commit(
            TurnCommit(
                "s1",
                "t1",
                T0,
                events=[assistant, call],
                turn_patch=TurnPatch(usage=Usage(1200, 40), rounds=1),
                owner=REPLICA,
            )
        )
    assert len(log.statements) == 4 + follows, log.statements

    with counting(engine) as log:
        await store.commit(TurnCommit("s1", "t1", T0, events=[result], owner=REPLICA))
    # No patch: the turn's conditions are checked with SELECT ... FOR UPDATE instead.
    assert len(log.statements) == 4 + follows, log.statements

    with counting(engine) as log:
        await store.commit(end_commit("s1", "t1", TurnEndReason.COMPLETED, events=[final]))
    assert len(log.statements) == 4 + follows, log.statements


async def test_small_units_of_work(store: SqlSessionStore, engine: AsyncEngine) -> None:
    await store.create_session(new_session("s1"))
    await store.start_turn(turn_start("s1", "t1"))

    follows = FOLLOWS if store.signals is not None else 0
    budgets: dict[str, tuple[Callable[[], Awaitable[object]], int]] = {
        "renew_lease": (lambda: store.renew_lease("t1", REPLICA, T0 + LEASE), 1),
        "request_cancel": (lambda: store.request_cancel("t1"), 1),
        "get_turn": (lambda: store.get_turn("t1"), 1),
        "events_after": (lambda: store.events_after("s1", 0, 100), 1),
        "list_messages": (lambda: store.list_messages("s1", 0, 100), 1),
        "load_context": (lambda: store.load_context("s1"), 2),
        "turn end alone": (lambda: store.commit(end_commit("s1", "t1")), 3 + follows),
    }
    for name, (call, budget) in budgets.items():
        with counting(engine) as log:
            await call()
        assert len(log.statements) == budget, (name, log.statements)
