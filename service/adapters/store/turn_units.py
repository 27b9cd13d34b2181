"""A turn's units of work on SQLAlchemy Core, and the checks every store path shares.

``SqlTurnUnits`` opens a turn and commits a turn's events on an open transaction
(SQLite, and the SQLAlchemy path of PostgreSQL); ``service/adapters/store/pg.py`` does
the same on PostgreSQL with one server-side function call each (decision 0113). Both
number events the same way (docs/spec/api-and-streams.md: per session, from 1, no gaps, no reuse):
one
``UPDATE sessions SET last_sequence = last_sequence + n ... RETURNING last_sequence`` in
the transaction that stores the events, which takes the session row's lock, so the
writers of one session queue there and a rolled-back transaction gives its numbers back.
Every unit of work locks the session row first, then the turn row, so two cannot
deadlock on each other.

Statements (pinned by ``tests/integration/test_store_statements.py``; BEGIN and COMMIT
come on top, and on SQLite the BEGIN IMMEDIATE is a statement of its own):

- ``start_turn``: 6 -- UPDATE sessions (lock and number), SELECT the session's running
  turn and request-id twin, SELECT the running-turn counts, INSERT messages, INSERT
  turns, INSERT session_events.
- ``commit`` with events and a turn patch: 4 -- UPDATE sessions, UPDATE turns with the
  commit's conditions in its WHERE, INSERT messages (when any), INSERT session_events.

With ``notify`` (PostgreSQL), the UPDATE that numbers events also calls
``pg_notify('ballet_planner_events', '<session_id> <last_sequence> <replica_id>')`` in
its RETURNING clause: PostgreSQL delivers a notification only when its transaction
commits, so a rolled-back transaction notifies nobody, at no extra statement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Select,
    and_,
    cast,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy import Text as SqlText
from sqlalchemy.ext.asyncio import AsyncConnection

from service.adapters.store import codec
from service.adapters.store.tables import (
    ENDED,
    IS_RUNNING,
    RUNNING,
    messages,
    session_events,
    sessions,
    turns,
)
from service.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StoreConflict,
)
from service.core.estimate import messages_tokens
from service.core.model import MESSAGE_EVENTS, ContextEstimate, SessionEvent, TurnState
from service.core.ports import (
    RunningLimits,
    StartOutcomeKind,
    SummaryUpdate,
    TurnCommit,
    TurnPatch,
    TurnStart,
    TurnStartOutcome,
)

#: PostgreSQL notification channels (payloads in the module docstring of ``repository``).
EVENTS_CHANNEL = "ballet_planner_events"
CANCEL_CHANNEL = "ballet_planner_cancel"

#: Seconds a caller refused with TOO_MANY_TURNS should wait (``google.rpc.RetryInfo``).
TOO_MANY_TURNS_RETRY_S = 1.0

# Message columns of an event row carry this prefix (``codec.event_from_row``).
MESSAGE_PREFIX = "m_"


class Undo(Exception):
    """Roll the unit of work back and return ``outcome`` (a start that stores nothing)."""

    def __init__(self, outcome: TurnStartOutcome) -> None:
        super().__init__(outcome.kind.value)
        self.outcome = outcome


# ---------------------------------------------------------------------- shared checks


def checked_start(start: TurnStart) -> int:
    """Check a ``TurnStart`` and return the index of the event carrying its message.

    Raises ``ValueError`` for malformed input: no request id, a turn not running, events
    of another session or turn, a naive ``now``, no event carrying ``start.message``.
    """
    turn = start.turn
    utc(start.now)
    if not turn.request_id:
        raise ValueError("a turn needs its request_id (required on send_message)")
    if turn.state is not TurnState.RUNNING:
        raise ValueError(f"a new turn must be running, not {turn.state.value}")
    check_events(turn.session_id, turn.turn_id, start.events)
    for index, event in enumerate(start.events):
        if event.message is not None and event.message.message_id == start.message.message_id:
            return index
    raise ValueError("start.events must carry start.message (message_accepted)")


def check_events(session_id: str, turn_id: str, events: Iterable[SessionEvent]) -> None:
    """Refuse events that do not belong to the unit of work (``ValueError``): a bug in
    the caller must not store one session's messages in another."""
    for event in events:
        if event.session_id != session_id or event.turn_id != turn_id:
            raise ValueError(
                f"a {event.kind.value} event of session {event.session_id!r}, turn "
                f"{event.turn_id!r} in a unit of work of {session_id!r}, {turn_id!r}"
            )
        message = event.message
        if (message is not None) != (event.kind in MESSAGE_EVENTS):
            raise ValueError(f"a {event.kind.value} event must carry a message iff it stores one")
        if message is not None and (message.session_id != session_id or message.turn_id != turn_id):
            raise ValueError(f"the message of a {event.kind.value} event belongs elsewhere")


def utc(moment: datetime) -> datetime:
    """``moment`` in UTC; a naive datetime is refused (``ValueError``), since its zone
    would be a guess and leases compare these times across replicas."""
    if moment.tzinfo is None:
        raise ValueError(f"naive datetime {moment!r}: the store needs aware times")
    return moment.astimezone(UTC)


def message_tokens(events: Iterable[SessionEvent]) -> int:
    """The estimated tokens of the messages ``events`` store (docs/spec/compaction.md; decision
    0171)."""
    return messages_tokens(event.message for event in events if event.message is not None)


def numbered(events: Sequence[SessionEvent], last_sequence: int) -> list[SessionEvent]:
    """``events`` numbered so that the last one is ``last_sequence``."""
    first = last_sequence - len(events) + 1
    return [event.with_sequence(first + i) for i, event in enumerate(events)]


def too_many_turns(scope: str, limits: RunningLimits) -> ResourceExhausted:
    """The refusal of a start over the running-turn limit of ``scope`` (docs/spec/limits.md)."""
    if scope == "human":
        message = f"at most {limits.per_human} turns may run at once for one human"
    else:
        message = f"at most {limits.per_project} turns may run at once in one project"
    return ResourceExhausted(
        message, reason="TOO_MANY_TURNS", retry_after_s=TOO_MANY_TURNS_RETRY_S
    )


def request_id_reused() -> InvalidArgument:
    return InvalidArgument(
        "request_id was used before with a different message", reason="REQUEST_ID_REUSED"
    )


def turn_in_progress() -> FailedPrecondition:
    return FailedPrecondition("another turn is running in this session", reason="TURN_IN_PROGRESS")


def session_not_found() -> NotFound:
    return NotFound("no such session", reason="SESSION_NOT_FOUND")


# ---------------------------------------------------------------------- SQLAlchemy


class SqlTurnUnits:
    """The turn's units of work as SQLAlchemy Core statements on an open transaction;
    ``notify`` names this replica in the events notification (None: send none)."""

    def __init__(self, notify: str | None) -> None:
        self._notify = notify

    async def start_turn(
        self, conn: AsyncConnection, start: TurnStart, human_index: int
    ) -> TurnStartOutcome:
        """Open the turn (``SqlSessionStore.start_turn`` has the rules); raises
        ``Undo`` for an outcome that stores nothing, or a refusal."""
        turn = start.turn
        last = await self.advance_session(
            conn, turn.session_id, start.events, now=start.now, context=None, summary=None
        )
        if last is None:
            raise session_not_found()
        await self._check_start(conn, start)
        stored_events = numbered(start.events, last)
        stored = dataclasses.replace(turn, human_sequence=stored_events[human_index].sequence)
        await conn.execute(
            insert(turns).values({**codec.turn_row(stored), "project_id": start.project_id})
        )
        await insert_events(conn, stored_events)
        return TurnStartOutcome(StartOutcomeKind.STARTED, stored, stored_events)

    async def _check_start(self, conn: AsyncConnection, start: TurnStart) -> None:
        turn = start.turn
        # One statement finds both the request id's twin and the running turn.
        rows = (
            (
                await conn.execute(
                    select(turns).where(
                        turns.c.session_id == turn.session_id,
                        or_(turns.c.request_id == turn.request_id, IS_RUNNING),
                    )
                )
            )
            .mappings()
            .all()
        )
        twin = next((row for row in rows if row["request_id"] == turn.request_id), None)
        if twin is not None:
            if twin["request_hash"] != turn.request_hash:
                raise request_id_reused()
            original = codec.turn_from_row(twin)
            accepted = await event_at(conn, turn.session_id, original.human_sequence)
            raise Undo(
                TurnStartOutcome(
                    StartOutcomeKind.DUPLICATE, original, () if accepted is None else (accepted,)
                )
            )
        running = next((row for row in rows if row["state"] == RUNNING), None)
        if running is not None:
            lease = running["lease_expires_at"]
            if lease is not None and lease > start.now:
                raise turn_in_progress()
            raise Undo(
                TurnStartOutcome(StartOutcomeKind.EXPIRED_TURN, codec.turn_from_row(running))
            )
        counts = (
            await conn.execute(
                select(
                    _running_count(turns.c.human_id == turn.human_id, start.now).label("human"),
                    _running_count(turns.c.project_id == start.project_id, start.now).label(
                        "project"
                    ),
                )
            )
        ).one()
        if counts.human >= start.limits.per_human:
            raise too_many_turns("human", start.limits)
        if counts.project >= start.limits.per_project:
            raise too_many_turns("project", start.limits)

    async def commit(self, conn: AsyncConnection, commit: TurnCommit) -> list[SessionEvent]:
        """Apply one ``TurnCommit`` (``SqlSessionStore.commit`` has the rules); raises
        ``StoreConflict`` when a condition fails."""
        last = await self.advance_session(
            conn,
            commit.session_id,
            commit.events,
            now=commit.now,
            context=commit.context,
            summary=commit.summary,
        )
        if last is None:
            raise StoreConflict(f"session {commit.session_id} is gone")
        if not await _claim_turn(conn, commit):
            raise StoreConflict(
                f"turn {commit.turn_id} is not running under the commit's conditions"
            )
        stored = numbered(commit.events, last)
        await insert_events(conn, stored)
        return stored

    async def advance_session(
        self,
        conn: AsyncConnection,
        session_id: str,
        events: Sequence[SessionEvent],
        *,
        now: datetime,
        context: ContextEstimate | None,
        summary: SummaryUpdate | None,
    ) -> int | None:
        """Lock the session row, reserve ``len(events)`` sequences and apply the context
        and summary, in one UPDATE; returns the new ``last_sequence`` (None: no session).

        With ``notify`` and events, the RETURNING clause also queues the events
        notification, delivered only if the transaction commits.
        """
        values: dict[str, Any] = {"last_sequence": sessions.c.last_sequence + len(events)}
        if context is None:
            added = message_tokens(events)
            if added:
                values["context_pending_tokens"] = sessions.c.context_pending_tokens + added
        else:
            values["context_base_tokens"] = context.base_tokens
            values["context_pending_tokens"] = context.pending_tokens
        if summary is not None:
            values["summary"] = summary.summary
            values["summary_up_to"] = summary.up_to
            values["update_time"] = now
        stmt = (
            update(sessions)
            .where(sessions.c.session_id == session_id)
            .values(values)
            .returning(sessions.c.last_sequence)
        )
        if self._notify is not None and events:
            payload = (
                sessions.c.session_id
                + literal(" ")
                + cast(sessions.c.last_sequence, SqlText)
                + literal(f" {self._notify}")
            )
            stmt = stmt.returning(func.pg_notify(EVENTS_CHANNEL, payload).label("notified"))
        row = (await conn.execute(stmt)).first()
        return None if row is None else int(row.last_sequence)


def select_events() -> Select[Any]:
    """Session events, each joined with the message it stored (outer: most events
    store none)."""
    return select(
        session_events,
        *(column.label(MESSAGE_PREFIX + column.name) for column in messages.c),
    ).select_from(
        session_events.outerjoin(
            messages,
            and_(
                messages.c.session_id == session_events.c.session_id,
                messages.c.sequence == session_events.c.sequence,
            ),
        )
    )


async def event_at(conn: AsyncConnection, session_id: str, sequence: int) -> SessionEvent | None:
    stmt = select_events().where(
        session_events.c.session_id == session_id, session_events.c.sequence == sequence
    )
    row = (await conn.execute(stmt)).mappings().first()
    return None if row is None else codec.event_from_row(row, MESSAGE_PREFIX)


def lease_expired(before: datetime) -> ColumnElement[bool]:
    # A running turn without a lease counts as expired, so it can always be recovered.
    return or_(turns.c.lease_expires_at.is_(None), turns.c.lease_expires_at < before)


def _running_count(condition: ColumnElement[bool], now: datetime) -> Any:
    return (
        select(func.count())
        .select_from(turns)
        .where(IS_RUNNING, condition, turns.c.lease_expires_at > now)
        .scalar_subquery()
    )


async def _claim_turn(conn: AsyncConnection, commit: TurnCommit) -> bool:
    """Check a commit's conditions on the turn row and apply its patch, locking the row;
    False when a condition fails."""
    conditions: list[ColumnElement[bool]] = [
        turns.c.turn_id == commit.turn_id,
        turns.c.session_id == commit.session_id,
        IS_RUNNING,
    ]
    if commit.owner is not None:
        conditions.append(turns.c.owner == commit.owner)
    if commit.lease_expired_before is not None:
        conditions.append(lease_expired(commit.lease_expired_before))
    values = patch_values(commit.turn_patch, commit.now)
    if values:
        stmt: Any = update(turns).where(*conditions).values(values).returning(turns.c.turn_id)
    else:
        stmt = select(turns.c.turn_id).where(*conditions).with_for_update()
    return (await conn.execute(stmt)).first() is not None


def patch_values(patch: TurnPatch | None, now: datetime) -> dict[str, Any]:
    """The ``turns`` column values a ``TurnPatch`` sets (ending the turn at ``now``)."""
    if patch is None:
        return {}
    values: dict[str, Any] = {}
    for name in (
        "rounds",
        "writes",
        "instructions_version",
        "tool_schema_version",
        "skill_name",
        "skill_version",
        "model",
        "error_reason",
        "error_message",
    ):
        value = getattr(patch, name)
        if value is not None:
            values[name] = value
    if patch.usage is not None:
        values["usage_input_tokens"] = patch.usage.input_tokens
        values["usage_output_tokens"] = patch.usage.output_tokens
    if patch.compaction_usage is not None:
        values["compaction_input_tokens"] = patch.compaction_usage.input_tokens
        values["compaction_output_tokens"] = patch.compaction_usage.output_tokens
    if patch.end_reason is not None:
        values["end_reason"] = patch.end_reason.value
        values["state"] = ENDED
        values["end_time"] = now
    return values


async def insert_events(conn: AsyncConnection, stored: Sequence[SessionEvent]) -> None:
    """One multi-row INSERT for the messages and one for the events."""
    message_rows = [codec.message_row(e.message) for e in stored if e.message is not None]
    if message_rows:
        await conn.execute(insert(messages).values(message_rows))
    if stored:
        await conn.execute(insert(session_events).values([codec.event_row(e) for e in stored]))
