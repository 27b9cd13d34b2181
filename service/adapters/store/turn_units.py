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

No unit of work here notifies other replicas: the store signals after the commit
(``signals.py``, decision 0230).
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
    bindparam,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from service.adapters.store import codec
from service.adapters.store.tables import (
    ENDED,
    IS_QUEUED,
    IS_RUNNING,
    QUEUED,
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
from service.core.model import (
    MESSAGE_EVENTS,
    ContextEstimate,
    EventKind,
    MessageQueuedData,
    OnBusy,
    SessionEvent,
    Turn,
    TurnEndedData,
    TurnEndReason,
    TurnStartedData,
    TurnState,
    Usage,
)
from service.core.ports import (
    Enqueue,
    Promoted,
    Promotion,
    RunningLimits,
    StartOutcomeKind,
    SummaryUpdate,
    TurnCommit,
    TurnPatch,
    TurnStart,
    TurnStartOutcome,
)

#: Seconds a caller refused with TOO_MANY_TURNS should wait (``google.rpc.RetryInfo``).
TOO_MANY_TURNS_RETRY_S = 1.0

# Message columns of an event row carry this prefix (``codec.event_from_row``).
MESSAGE_PREFIX = "m_"


class Undone(Exception):
    """Roll the unit of work back: it found nothing to do."""


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
    return ResourceExhausted(message, reason="TOO_MANY_TURNS", retry_after_s=TOO_MANY_TURNS_RETRY_S)


#: ``turns.cancel_reason`` of a turn an INTERRUPT stopped (decision 0301).
INTERRUPTED_BY_MESSAGE = TurnEndReason.INTERRUPTED_BY_MESSAGE.value


def queue_full(limit: int) -> ResourceExhausted:
    """The refusal of a message over a session's queue bound (decision 0300)."""
    return ResourceExhausted(
        f"at most {limit} messages may wait in one session's queue; wait for a turn to end",
        reason="QUEUE_FULL",
        retry_after_s=TOO_MANY_TURNS_RETRY_S,
    )


def queue_place(
    enqueue: Enqueue, running_turn_id: str, queued: Sequence[tuple[str, int, int]]
) -> tuple[int, str]:
    """A new queued turn's ``queue_priority`` and the turn it waits behind, given the
    session's running turn and its queued turns as ``(turn_id, queue_priority,
    human_sequence)``: an INTERRUPT goes before every ENQUEUE, after earlier INTERRUPTs
    (decision 0300). Raises ``queue_full`` when the queue is at its bound."""
    if len(queued) >= enqueue.max_queued:
        raise queue_full(enqueue.max_queued)
    priority = 1 if enqueue.on_busy is OnBusy.INTERRUPT else 0
    ahead = sorted((q for q in queued if q[1] >= priority), key=lambda q: (-q[1], q[2]))
    return priority, ahead[-1][0] if ahead else running_turn_id


def queued_event(enqueue: Enqueue, behind_turn_id: str) -> SessionEvent:
    """``enqueue.event`` naming the turn it waits behind."""
    data = enqueue.event.data
    assert isinstance(data, MessageQueuedData)
    return dataclasses.replace(
        enqueue.event, data=dataclasses.replace(data, behind_turn_id=behind_turn_id)
    )


def queued_turn(start: TurnStart, sequence: int, behind_turn_id: str) -> Turn:
    """``start.turn`` as a QUEUED turn whose ``message_queued`` is numbered ``sequence``."""
    return dataclasses.replace(
        start.turn,
        state=TurnState.QUEUED,
        human_sequence=sequence,
        owner="",
        lease_expires_at=None,
        behind_turn_id=behind_turn_id,
        queued_text=start.message.text,
    )


def promotion_events(
    turn_id: str, session_id: str, message_json: str, promotion: Promotion, now: datetime
) -> list[SessionEvent]:
    """The ``message_accepted`` (the queued message) and ``turn_started`` of a promoted
    turn, unnumbered; ``planner_end_turn`` (migration 0008) stores the same rows."""
    message = codec.queued_message_from_json(message_json, session_id, 0)
    return [
        SessionEvent(session_id, turn_id, EventKind.MESSAGE_ACCEPTED, now, message=message),
        SessionEvent(
            session_id,
            turn_id,
            EventKind.TURN_STARTED,
            now,
            data=TurnStartedData(promotion.model, promotion.max_rounds),
        ),
    ]


def joined_events(
    session_id: str, turn_id: str, joined: Sequence[tuple[str, str]], now: datetime
) -> list[SessionEvent]:
    """For each queued JOIN turn ``(queued turn id, queued message JSON)``, in
    order: its message as a human message of running turn ``turn_id`` with its
    ``message_accepted``, and the queued turn's ``turn_ended`` (``JOINED``); unnumbered
    (decision 0303)."""
    events: list[SessionEvent] = []
    for queued_id, message_json in joined:
        message = dataclasses.replace(
            codec.queued_message_from_json(message_json, session_id, 0), turn_id=turn_id
        )
        events.append(
            SessionEvent(session_id, turn_id, EventKind.MESSAGE_ACCEPTED, now, message=message)
        )
        ended = TurnEndedData(TurnEndReason.JOINED, Usage(), Usage(), 0)
        events.append(SessionEvent(session_id, queued_id, EventKind.TURN_ENDED, now, data=ended))
    return events


def promoted_turn(queued: Turn, promotion: Promotion, now: datetime, sequence: int) -> Turn:
    """A queued turn as it runs once promoted, its message numbered ``sequence``."""
    return dataclasses.replace(
        queued,
        state=TurnState.RUNNING,
        start_time=now,
        human_sequence=sequence,
        model=promotion.model,
        owner=promotion.owner,
        lease_expires_at=promotion.lease_expires_at,
        queued_text="",
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
    """The turn's units of work as SQLAlchemy Core statements on an open transaction."""

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

    async def enqueue(self, conn: AsyncConnection, start: TurnStart) -> TurnStartOutcome | None:
        """Store ``start`` as a QUEUED turn behind the session's running turn (decision
        0300); None when no turn runs under a lease that holds (the caller starts the
        turn again). Raises ``queue_full``."""
        enqueue = start.enqueue
        assert enqueue is not None
        turn = start.turn
        last = await self.advance_session(
            conn, turn.session_id, [enqueue.event], now=start.now, context=None, summary=None
        )
        if last is None:
            raise session_not_found()
        rows = (
            (
                await conn.execute(
                    select(
                        turns.c.turn_id,
                        turns.c.state,
                        turns.c.lease_expires_at,
                        turns.c.queue_priority,
                        turns.c.human_sequence,
                    ).where(turns.c.session_id == turn.session_id, or_(IS_RUNNING, IS_QUEUED))
                )
            )
            .mappings()
            .all()
        )
        running = next((r for r in rows if r["state"] == RUNNING), None)
        if running is None or running["lease_expires_at"] is None:
            return None
        if running["lease_expires_at"] <= start.now:
            return None
        priority, behind = queue_place(
            enqueue,
            running["turn_id"],
            [
                (r["turn_id"], r["queue_priority"], r["human_sequence"])
                for r in rows
                if r["state"] == QUEUED
            ],
        )
        event = queued_event(enqueue, behind).with_sequence(last)
        queued = queued_turn(start, last, behind)
        await conn.execute(
            insert(turns).values(
                {
                    **codec.turn_row(queued),
                    "project_id": start.project_id,
                    "queued_message": codec.queued_message_json(start.message),
                    "queued_token": enqueue.token,
                    "queued_tokens": message_tokens(start.events),
                    "queue_priority": priority,
                    "on_busy": enqueue.on_busy.value,
                }
            )
        )
        await insert_events(conn, [event])
        join_into = None
        if enqueue.on_busy is OnBusy.JOIN:
            row = (
                (
                    await conn.execute(
                        update(turns)
                        .where(turns.c.turn_id == running["turn_id"])
                        .values(join_pending=True)
                        .returning(*turns.c)
                    )
                )
                .mappings()
                .one()
            )
            join_into = codec.turn_from_row(row)
        interrupted = None
        if enqueue.on_busy is OnBusy.INTERRUPT:
            row = (
                (
                    await conn.execute(
                        update(turns)
                        .where(turns.c.turn_id == running["turn_id"])
                        .values(cancel_requested=True, cancel_reason=INTERRUPTED_BY_MESSAGE)
                        .returning(*turns.c)
                    )
                )
                .mappings()
                .one()
            )
            interrupted = codec.turn_from_row(row)
        return TurnStartOutcome(
            StartOutcomeKind.QUEUED, queued, [event], interrupted, join_into=join_into
        )

    async def promote(
        self, conn: AsyncConnection, session_id: str, promotion: Promotion, now: datetime
    ) -> Promoted | None:
        """Start the session's first queued turn (decision 0300), in the transaction of
        the ending just stored; None when none waits."""
        row = (
            (
                await conn.execute(
                    select(turns)
                    .where(turns.c.session_id == session_id, IS_QUEUED)
                    .order_by(turns.c.queue_priority.desc(), turns.c.human_sequence)
                    .limit(1)
                    .with_for_update()
                )
            )
            .mappings()
            .first()
        )
        if row is None:
            return None
        events = promotion_events(row["turn_id"], session_id, row["queued_message"], promotion, now)
        last = await self.advance_session(
            conn, session_id, events, now=now, context=None, summary=None
        )
        assert last is not None
        stored = numbered(events, last)
        await insert_events(conn, stored)
        turn = promoted_turn(codec.turn_from_row(row), promotion, now, last - 1)
        await conn.execute(
            update(turns)
            .where(turns.c.turn_id == turn.turn_id)
            .values(
                state=RUNNING,
                start_time=turn.start_time,
                human_sequence=turn.human_sequence,
                model=turn.model,
                owner=turn.owner,
                lease_expires_at=turn.lease_expires_at,
                queued_message=None,
                queued_token=None,
            )
        )
        return Promoted(turn, stored, row["queued_token"] or "")

    async def join_queued(
        self, conn: AsyncConnection, session_id: str, turn_id: str, owner: str, now: datetime
    ) -> list[SessionEvent]:
        """Take the session's queued JOIN messages into running turn ``turn_id``
        (``SqlSessionStore.join_queued`` has the rules)."""
        rows = (
            (
                await conn.execute(
                    select(turns)
                    .where(
                        turns.c.session_id == session_id,
                        IS_QUEUED,
                        turns.c.on_busy == OnBusy.JOIN.value,
                    )
                    .order_by(turns.c.human_sequence)
                    .with_for_update()
                )
            )
            .mappings()
            .all()
        )
        events = joined_events(
            session_id,
            turn_id,
            [(row["turn_id"], row["queued_message"]) for row in rows],
            now,
        )
        last = await self.advance_session(
            conn, session_id, events, now=now, context=None, summary=None
        )
        if last is None:
            raise StoreConflict(f"session {session_id} is gone")
        claimed = (
            await conn.execute(
                update(turns)
                .where(
                    turns.c.turn_id == turn_id,
                    turns.c.session_id == session_id,
                    turns.c.owner == owner,
                    IS_RUNNING,
                )
                .values(join_pending=False)
                .returning(turns.c.turn_id)
            )
        ).first()
        if claimed is None:
            raise StoreConflict(f"turn {turn_id} is not {owner}'s running turn")
        if not rows:
            return []
        await conn.execute(
            update(turns)
            .where(turns.c.turn_id.in_([row["turn_id"] for row in rows]))
            .values(
                state=ENDED,
                end_reason=TurnEndReason.JOINED.value,
                end_time=now,
                queued_message=None,
                queued_token=None,
            )
        )
        stored = numbered(events, last)
        await insert_events(conn, stored)
        return stored

    async def cancel_queued(
        self, conn: AsyncConnection, turn_id: str, event: SessionEvent
    ) -> list[SessionEvent]:
        """End a QUEUED turn CANCELLED, storing ``event`` (its ``turn_ended``); [] when
        it is not queued. The session row is locked first, as everywhere."""
        last = await self.advance_session(
            conn, event.session_id, [event], now=event.create_time, context=None, summary=None
        )
        if last is None:
            return []
        ended = (
            await conn.execute(
                update(turns)
                .where(
                    turns.c.turn_id == turn_id, turns.c.session_id == event.session_id, IS_QUEUED
                )
                .values(
                    state=ENDED,
                    end_reason=TurnEndReason.CANCELLED.value,
                    end_time=event.create_time,
                    queued_message=None,
                    queued_token=None,
                )
                .returning(turns.c.turn_id)
            )
        ).first()
        if ended is None:
            raise Undone()
        stored = numbered([event], last)
        await insert_events(conn, stored)
        return stored

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


#: A session's events after a sequence, in order, each with its message; parameters
#: ``session_id``, ``after_sequence`` and ``limit`` (a stream's replay and catch-up;
#: ``pg.py`` runs the same statement on the hot path).
EVENTS_AFTER: Select[Any] = (
    select_events()
    .where(
        session_events.c.session_id == bindparam("session_id"),
        session_events.c.sequence > bindparam("after_sequence"),
    )
    .order_by(session_events.c.sequence)
    .limit(bindparam("limit"))
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
