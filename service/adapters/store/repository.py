"""``SqlSessionStore``: the core's ``SessionStore`` port on SQLAlchemy Core (SPEC 3, 5, 8).

One unit of work per method: a write runs in one ``engine.begin()`` transaction, a read on
a read-only connection (``engine.read_only``), never shared between tasks. Database errors
are translated in one place (``errors.translated``).

Sequences (SPEC 3: per session, from 1, no gaps, no reuse) are assigned by one
``UPDATE sessions SET last_sequence = last_sequence + n ... RETURNING last_sequence`` in
the transaction that stores the events. The UPDATE takes the session row's lock, so the
writers of one session queue there, and a rolled-back transaction gives its numbers back.
Every write transaction that touches a session and a turn locks the session row first,
so two of them cannot deadlock on each other.

Statement budget (pinned by ``tests/integration/test_store_statements.py``; BEGIN and
COMMIT come on top, and on SQLite the BEGIN IMMEDIATE is a statement of its own):

- ``start_turn``: 6 — UPDATE sessions (lock and number), SELECT the session's running
  turn and request-id twin, SELECT the running-turn counts, INSERT messages, INSERT
  turns, INSERT session_events.
- ``commit`` with events and a turn patch: 4 — UPDATE sessions, UPDATE turns with the
  commit's conditions in its WHERE, INSERT messages (when any), INSERT session_events.

Cross-replica notification: with ``notify`` (PostgreSQL), the UPDATE that numbers events
also calls ``pg_notify('ballet_planner_events', '<session_id> <last_sequence>
<replica_id>')`` in its RETURNING clause: PostgreSQL delivers a notification only when
its transaction commits, so a rolled-back transaction notifies nobody, and it costs no
extra statement. ``request_cancel`` sends ``pg_notify('ballet_planner_cancel',
'<turn_id>')``; ``delete_session`` sends ``'<session_id> -1 <replica_id>'`` on the events
channel (and a cancel for its running turn). ``service.adapters.bus.PgNotifier``
receives them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Select,
    and_,
    cast,
    delete,
    func,
    insert,
    literal,
    or_,
    select,
    text,
    update,
)
from sqlalchemy import Text as SqlText
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.adapters.store import codec
from service.adapters.store.engine import is_postgresql, read_only
from service.adapters.store.errors import RequestIdTaken, translated
from service.adapters.store.tables import (
    ENDED,
    HAS_CREATE_REQUEST_ID,
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
    StoreUnavailable,
)
from service.core.estimate import messages_tokens
from service.core.model import (
    MESSAGE_EVENTS,
    ContextEstimate,
    Message,
    Session,
    SessionEvent,
    Turn,
    TurnState,
)
from service.core.ports import (
    ContextSnapshot,
    LeaseStatus,
    NewSession,
    SessionCursor,
    SessionQuery,
    StartOutcomeKind,
    SummaryUpdate,
    TurnCommit,
    TurnPatch,
    TurnStart,
    TurnStartOutcome,
)

__all__ = ["CANCEL_CHANNEL", "EVENTS_CHANNEL", "SqlSessionStore"]

#: PostgreSQL notification channels (payloads in the module docstring).
EVENTS_CHANNEL = "ballet_planner_events"
CANCEL_CHANNEL = "ballet_planner_cancel"

#: The ``last_sequence`` of an events notification that says the session was deleted.
DELETED_SEQUENCE = -1

#: Seconds a caller refused with TOO_MANY_TURNS should wait (``google.rpc.RetryInfo``).
TOO_MANY_TURNS_RETRY_S = 1.0

# The session's running turn id, for ``Session.running_turn_id`` (NULL: none).
_RUNNING_TURN_ID = (
    select(turns.c.turn_id)
    .where(turns.c.session_id == sessions.c.session_id, IS_RUNNING)
    .scalar_subquery()
    .label("running_turn_id")
)


class _Undo(Exception):
    """Roll the unit of work back and return ``outcome`` (a start that stores nothing)."""

    def __init__(self, outcome: TurnStartOutcome) -> None:
        super().__init__(outcome.kind.value)
        self.outcome = outcome


class SqlSessionStore:
    """Sessions, transcripts, turns and events in PostgreSQL or SQLite.

    ``engine`` comes from ``make_engine``; ``replica_id`` names this process in turn
    ownership and notifications (no spaces: the notification payload is space-separated).
    ``notify`` sends PostgreSQL notifications to other replicas; None means "when the
    engine is PostgreSQL" (SQLite serves one process and has no notifications).
    """

    def __init__(self, engine: AsyncEngine, replica_id: str, notify: bool | None = None) -> None:
        if not replica_id or any(ch.isspace() for ch in replica_id):
            raise ValueError(f"replica id {replica_id!r} must be non-empty without spaces")
        postgresql = is_postgresql(engine)
        if notify is None:
            notify = postgresql
        if notify and not postgresql:
            raise ValueError("notifications need PostgreSQL")
        self._engine = engine
        self._reader = read_only(engine)
        self._replica_id = replica_id
        self._notify = notify

    # ------------------------------------------------------------------ units of work

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        with translated():
            async with self._engine.begin() as conn:
                yield conn

    @asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncConnection]:
        with translated():
            async with self._reader.connect() as conn:
                yield conn

    # ------------------------------------------------------------------ health

    async def ping(self) -> None:
        """Check the database answers (``SELECT 1``); raises ``StoreUnavailable``.

        A connection the database dropped (a restart) fails once and makes the pool
        discard its connections; the check then retries once on a fresh connection, so
        readiness reflects the database, not the pool's memory of it.
        """
        for attempt in range(2):
            try:
                async with self._read() as conn:
                    await conn.execute(text("SELECT 1"))
                return
            except StoreUnavailable as exc:
                if attempt or not getattr(exc.__cause__, "connection_invalidated", False):
                    raise

    # ------------------------------------------------------------------ sessions

    async def create_session(self, new: NewSession) -> Session:
        """Create a session, or return the one created before with the same (owner,
        request_id) and payload (AIP-155; the key lives as long as the session).

        A different payload (``request_hash``) raises ``InvalidArgument``
        (``REQUEST_ID_REUSED``). An empty ``request_id`` is no key: each such call
        creates a session.
        """
        now = _utc(new.now)
        row = {
            "session_id": new.session_id,
            "project_id": new.project_id,
            "organization_id": new.organization_id,
            "owner_id": new.owner_id,
            "title": new.title,
            "create_time": now,
            "update_time": now,
            "summary": "",
            "summary_up_to": 0,
            "last_sequence": 0,
            "context_base_tokens": None,
            "context_pending_tokens": 0,
            "create_request_id": new.request_id,
            "create_request_hash": new.request_hash,
        }
        # Insert first: a duplicate is rare, so the common case is one statement. A
        # duplicate whose session was deleted meanwhile frees its key; try again.
        for _ in range(3):
            try:
                async with self._write() as conn:
                    await conn.execute(insert(sessions).values(row))
            except RequestIdTaken:
                found = await self._session_by_request(new.owner_id, new.request_id)
                if found is None:
                    continue
                session, request_hash = found
                if request_hash != new.request_hash:
                    raise InvalidArgument(
                        "request_id was used before with a different request",
                        reason="REQUEST_ID_REUSED",
                    ) from None
                return session
            return Session(
                session_id=new.session_id,
                project_id=new.project_id,
                organization_id=new.organization_id,
                owner_id=new.owner_id,
                title=new.title,
                create_time=now,
                update_time=now,
                create_request_id=new.request_id,
            )
        raise StoreConflict(f"the key of request {new.request_id!r} keeps changing")

    async def _session_by_request(
        self, owner_id: str, request_id: str
    ) -> tuple[Session, str] | None:
        async with self._read() as conn:
            row = (
                (
                    await conn.execute(
                        _select_sessions().where(
                            sessions.c.owner_id == owner_id,
                            sessions.c.create_request_id == request_id,
                            HAS_CREATE_REQUEST_ID,
                        )
                    )
                )
                .mappings()
                .first()
            )
        if row is None:
            return None
        return codec.session_from_row(row), row["create_request_hash"]

    async def get_session(self, session_id: str) -> Session | None:
        """The session, or None."""
        async with self._read() as conn:
            return await _session(conn, session_id)

    async def list_sessions(
        self, query: SessionQuery
    ) -> tuple[list[Session], SessionCursor | None]:
        """One page of a project's sessions, newest first, ties by id descending (SPEC 3,
        AIP-158 keyset pagination), and the cursor of the next page (None: last page).

        ``owner_id`` None lists every owner's (service principals). Raises
        ``ValueError`` when ``page_size`` < 1 (the transport applies the default).
        """
        if query.page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {query.page_size}")
        stmt = _select_sessions().where(
            sessions.c.project_id == query.project_id,
            sessions.c.organization_id == query.organization_id,
        )
        if query.owner_id is not None:
            stmt = stmt.where(sessions.c.owner_id == query.owner_id)
        if query.after is not None:
            stmt = stmt.where(
                or_(
                    sessions.c.create_time < query.after.create_time,
                    and_(
                        sessions.c.create_time == query.after.create_time,
                        sessions.c.session_id < query.after.session_id,
                    ),
                )
            )
        # One row more than the page tells whether another page follows.
        stmt = stmt.order_by(sessions.c.create_time.desc(), sessions.c.session_id.desc()).limit(
            query.page_size + 1
        )
        async with self._read() as conn:
            rows = (await conn.execute(stmt)).mappings().all()
        page = [codec.session_from_row(row) for row in rows[: query.page_size]]
        if len(rows) <= query.page_size:
            return page, None
        last = page[-1]
        return page, SessionCursor(create_time=last.create_time, session_id=last.session_id)

    async def update_session_title(
        self, session_id: str, title: str, now: datetime
    ) -> Session | None:
        """Set the title and ``update_time``; None when the session does not exist."""
        async with self._write() as conn:
            updated = (
                await conn.execute(
                    update(sessions)
                    .where(sessions.c.session_id == session_id)
                    .values(title=title, update_time=now)
                    .returning(sessions.c.session_id)
                )
            ).first()
            if updated is None:
                return None
            return await _session(conn, session_id)

    async def delete_session(self, session_id: str) -> bool:
        """Remove the session with its messages, events, turns and idempotency keys, in
        one transaction (SPEC 3, ``DeleteSession``; the foreign keys cascade). False when
        it did not exist.

        With ``notify``, other replicas hear ``'<session_id> -1 <replica_id>'`` on the
        events channel (their streams end with NOT_FOUND) and the running turn's id, if
        any, on the cancel channel (its owner stops it; its later commits conflict).
        """
        async with self._write() as conn:
            running = (
                (
                    await conn.execute(
                        select(turns.c.turn_id).where(turns.c.session_id == session_id, IS_RUNNING)
                    )
                )
                .scalars()
                .all()
            )
            deleted = (
                await conn.execute(
                    delete(sessions)
                    .where(sessions.c.session_id == session_id)
                    .returning(sessions.c.session_id)
                )
            ).first()
            if deleted is None:
                return False
            if self._notify:
                signals = [
                    func.pg_notify(
                        EVENTS_CHANNEL, f"{session_id} {DELETED_SEQUENCE} {self._replica_id}"
                    ),
                    *(func.pg_notify(CANCEL_CHANNEL, turn_id) for turn_id in running),
                ]
                await conn.execute(select(*signals))
        return True

    # ------------------------------------------------------------------ transcript

    async def list_messages(
        self, session_id: str, after_sequence: int, limit: int
    ) -> list[Message]:
        """Up to ``limit`` messages with a sequence above ``after_sequence``, in sequence
        order (SPEC 3, ``ListMessages``)."""
        stmt = (
            select(messages)
            .where(messages.c.session_id == session_id, messages.c.sequence > after_sequence)
            .order_by(messages.c.sequence)
            .limit(max(limit, 0))
        )
        async with self._read() as conn:
            rows = (await conn.execute(stmt)).mappings().all()
        return [codec.message_from_row(row) for row in rows]

    async def events_after(
        self, session_id: str, after_sequence: int, limit: int
    ) -> list[SessionEvent]:
        """Up to ``limit`` session events with a sequence above ``after_sequence``, in
        order (SPEC 3, replay), each as it was stored: message events with their message
        (joined from ``messages`` on the same sequence), the others with their payload."""
        stmt = (
            _select_events()
            .where(
                session_events.c.session_id == session_id,
                session_events.c.sequence > after_sequence,
            )
            .order_by(session_events.c.sequence)
            .limit(max(limit, 0))
        )
        async with self._read() as conn:
            rows = (await conn.execute(stmt)).mappings().all()
        return [codec.event_from_row(row, _MESSAGE_PREFIX) for row in rows]

    async def turn_messages(self, turn_id: str) -> list[Message]:
        """The messages of one turn, in sequence order."""
        stmt = select(messages).where(messages.c.turn_id == turn_id).order_by(messages.c.sequence)
        async with self._read() as conn:
            rows = (await conn.execute(stmt)).mappings().all()
        return [codec.message_from_row(row) for row in rows]

    async def load_context(self, session_id: str) -> ContextSnapshot | None:
        """The session and the messages after its summary's ``up_to``, in sequence order
        (SPEC 6; T1: no message older than the summary is read). None when it is gone."""
        async with self._read() as conn:
            session = await _session(conn, session_id)
            if session is None:
                return None
            rows = (
                (
                    await conn.execute(
                        select(messages)
                        .where(
                            messages.c.session_id == session_id,
                            messages.c.sequence > session.summary_up_to,
                        )
                        .order_by(messages.c.sequence)
                    )
                )
                .mappings()
                .all()
            )
        return ContextSnapshot(
            session=session, messages=[codec.message_from_row(row) for row in rows]
        )

    # ------------------------------------------------------------------ turns

    async def get_turn(self, turn_id: str) -> Turn | None:
        """The turn, or None."""
        async with self._read() as conn:
            row = (
                (await conn.execute(select(turns).where(turns.c.turn_id == turn_id)))
                .mappings()
                .first()
            )
        return None if row is None else codec.turn_from_row(row)

    async def running_turns(
        self, *, owner: str | None = None, lease_expired_before: datetime | None = None
    ) -> list[Turn]:
        """Running turns, oldest first; only ``owner``'s, or only those whose lease
        expired before ``lease_expired_before`` (the sweeper, SPEC 5), when given."""
        stmt = select(turns).where(IS_RUNNING)
        if owner is not None:
            stmt = stmt.where(turns.c.owner == owner)
        if lease_expired_before is not None:
            stmt = stmt.where(_lease_expired(lease_expired_before))
        stmt = stmt.order_by(turns.c.start_time, turns.c.turn_id)
        async with self._read() as conn:
            rows = (await conn.execute(stmt)).mappings().all()
        return [codec.turn_from_row(row) for row in rows]

    async def start_turn(self, start: TurnStart) -> TurnStartOutcome:
        """Store the human message and open the turn, in one transaction (SPEC 3 and 5,
        step 1).

        The session row is locked first (by the UPDATE that numbers the events), then,
        in the port's order: the (session, request_id) duplicate check (same
        ``request_hash``: DUPLICATE with the original turn and its ``message_accepted``
        event; another: ``InvalidArgument``/``REQUEST_ID_REUSED``); a running turn whose
        lease holds at ``start.now``: ``FailedPrecondition``/``TURN_IN_PROGRESS``, one
        whose lease expired: EXPIRED_TURN; the running-turn limits, counting turns whose
        lease holds (SPEC 8): ``ResourceExhausted``/``TOO_MANY_TURNS`` with
        ``retry_after_s``. A missing session raises ``NotFound``/``SESSION_NOT_FOUND``.
        Every outcome but STARTED stores nothing.

        ``start.events`` must include the event carrying ``start.message``; the stored
        turn's ``human_sequence`` is that event's sequence. Raises ``ValueError`` for
        malformed input (no request id, events of another session or turn, a naive
        ``now``).
        """
        try:
            return await self._start_turn(start)
        except RequestIdTaken:
            # Lost a race for the request id (the session lock makes this unlikely): the
            # retry finds the winner and answers with a duplicate or REQUEST_ID_REUSED.
            return await self._start_turn(start)

    async def _start_turn(self, start: TurnStart) -> TurnStartOutcome:
        turn = start.turn
        _utc(start.now)
        if not turn.request_id:
            raise ValueError("a turn needs its request_id (SPEC 3: required on send_message)")
        if turn.state is not TurnState.RUNNING:
            raise ValueError(f"a new turn must be running, not {turn.state.value}")
        _check_events(turn.session_id, turn.turn_id, start.events)
        human_index = next(
            (
                i
                for i, event in enumerate(start.events)
                if event.message is not None
                and event.message.message_id == start.message.message_id
            ),
            None,
        )
        if human_index is None:
            raise ValueError("start.events must carry start.message (message_accepted)")
        try:
            async with self._write() as conn:
                last = await self._advance_session(
                    conn,
                    turn.session_id,
                    start.events,
                    now=start.now,
                    context=None,
                    summary=None,
                )
                if last is None:
                    raise NotFound("no such session", reason="SESSION_NOT_FOUND")
                await self._check_start(conn, start)
                numbered = _numbered(start.events, last)
                stored = dataclasses.replace(turn, human_sequence=numbered[human_index].sequence)
                await conn.execute(
                    insert(turns).values({**codec.turn_row(stored), "project_id": start.project_id})
                )
                await _insert_events(conn, numbered)
        except _Undo as undo:
            return undo.outcome
        return TurnStartOutcome(StartOutcomeKind.STARTED, stored, numbered)

    async def _check_start(self, conn: AsyncConnection, start: TurnStart) -> None:
        """The checks of ``start_turn`` after the session lock; raises a refusal or
        ``_Undo`` with the outcome, or returns when the turn may start."""
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
                raise InvalidArgument(
                    "request_id was used before with a different message",
                    reason="REQUEST_ID_REUSED",
                )
            original = codec.turn_from_row(twin)
            accepted = await _event_at(conn, turn.session_id, original.human_sequence)
            raise _Undo(
                TurnStartOutcome(
                    StartOutcomeKind.DUPLICATE,
                    original,
                    () if accepted is None else (accepted,),
                )
            )
        running = next((row for row in rows if row["state"] == RUNNING), None)
        if running is not None:
            lease = running["lease_expires_at"]
            if lease is not None and lease > start.now:
                raise FailedPrecondition(
                    "another turn is running in this session", reason="TURN_IN_PROGRESS"
                )
            raise _Undo(
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
            raise ResourceExhausted(
                f"at most {start.limits.per_human} turns may run at once for one human",
                reason="TOO_MANY_TURNS",
                retry_after_s=TOO_MANY_TURNS_RETRY_S,
            )
        if counts.project >= start.limits.per_project:
            raise ResourceExhausted(
                f"at most {start.limits.per_project} turns may run at once in one project",
                reason="TOO_MANY_TURNS",
                retry_after_s=TOO_MANY_TURNS_RETRY_S,
            )

    async def commit(self, commit: TurnCommit) -> list[SessionEvent]:
        """Apply one ``TurnCommit`` in one transaction and return its events, numbered
        (SPEC 5; T1: at most 4 per one-round turn).

        Conditions (``StoreConflict``, nothing stored, when one fails): the turn exists
        in ``commit.session_id`` and is RUNNING; ``owner``, when set, owns it;
        ``lease_expired_before``, when set, is after its lease's end. The session row is
        updated when anything of it changes: the counter (events), ``summary``, and the
        context estimate (``context``, or when None the stored messages' estimated tokens
        added to ``pending_tokens``). A ``turn_patch`` with ``end_reason`` ends the turn
        (state ENDED, ``end_time`` = ``commit.now``), which frees the session for the next.
        Raises ``ValueError`` for events of another session or turn, or a naive ``now``.
        """
        _utc(commit.now)
        _check_events(commit.session_id, commit.turn_id, commit.events)
        added = _message_tokens(commit.events)
        touches_session = (
            bool(commit.events)
            or commit.summary is not None
            or commit.context is not None
            or added > 0
        )
        async with self._write() as conn:
            last = 0
            if touches_session:
                advanced = await self._advance_session(
                    conn,
                    commit.session_id,
                    commit.events,
                    now=commit.now,
                    context=commit.context,
                    summary=commit.summary,
                )
                if advanced is None:
                    raise StoreConflict(f"session {commit.session_id} is gone")
                last = advanced
            if not await _claim_turn(conn, commit):
                raise StoreConflict(
                    f"turn {commit.turn_id} is not running under the commit's conditions"
                )
            numbered = _numbered(commit.events, last)
            await _insert_events(conn, numbered)
        return numbered

    async def renew_lease(self, turn_id: str, owner: str, until: datetime) -> LeaseStatus:
        """Extend the lease of a running turn ``owner`` holds to ``until`` (SPEC 5).

        ``held`` false: the turn ended, another replica took it over, or it is gone;
        ``cancel_requested`` tells the owner a cancel arrived (a notification may have
        been missed while the listener reconnected).
        """
        async with self._write() as conn:
            row = (
                await conn.execute(
                    update(turns)
                    .where(turns.c.turn_id == turn_id, turns.c.owner == owner, IS_RUNNING)
                    .values(lease_expires_at=until)
                    .returning(turns.c.cancel_requested)
                )
            ).first()
        if row is None:
            return LeaseStatus(held=False)
        return LeaseStatus(held=True, cancel_requested=bool(row.cancel_requested))

    async def request_cancel(self, turn_id: str) -> Turn | None:
        """Flag a running turn cancelled and, with ``notify``, send its id on the cancel
        channel in the same transaction (SPEC 3, ``CancelTurn``: the owner, on any
        replica, stops it within 1 s). Returns the turn as stored: an ended turn
        unchanged, None for an unknown one."""
        stmt = (
            update(turns)
            .where(turns.c.turn_id == turn_id, IS_RUNNING)
            .values(cancel_requested=True)
            .returning(*turns.c)
        )
        if self._notify:
            stmt = stmt.returning(func.pg_notify(CANCEL_CHANNEL, turns.c.turn_id).label("notified"))
        async with self._write() as conn:
            row = (await conn.execute(stmt)).mappings().first()
            if row is None:
                row = (
                    (await conn.execute(select(turns).where(turns.c.turn_id == turn_id)))
                    .mappings()
                    .first()
                )
        return None if row is None else codec.turn_from_row(row)

    # ------------------------------------------------------------------ helpers

    async def _advance_session(
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
        values: dict[str, Any] = {}
        if events:
            values["last_sequence"] = sessions.c.last_sequence + len(events)
        if context is None:
            added = _message_tokens(events)
            if added:
                values["context_pending_tokens"] = sessions.c.context_pending_tokens + added
        else:
            values["context_base_tokens"] = context.base_tokens
            values["context_pending_tokens"] = context.pending_tokens
        if summary is not None:
            values["summary"] = summary.summary
            values["summary_up_to"] = summary.up_to
            values["update_time"] = now
        if not values:
            # Nothing changes, but the row lock is still taken and the counter read.
            values["last_sequence"] = sessions.c.last_sequence
        stmt = (
            update(sessions)
            .where(sessions.c.session_id == session_id)
            .values(values)
            .returning(sessions.c.last_sequence)
        )
        if self._notify and events:
            payload = (
                sessions.c.session_id
                + literal(" ")
                + cast(sessions.c.last_sequence, SqlText)
                + literal(f" {self._replica_id}")
            )
            stmt = stmt.returning(func.pg_notify(EVENTS_CHANNEL, payload).label("notified"))
        row = (await conn.execute(stmt)).first()
        return None if row is None else int(row.last_sequence)


# ---------------------------------------------------------------------- module helpers


def _select_sessions() -> Select[Any]:
    return select(sessions, _RUNNING_TURN_ID)


async def _session(conn: AsyncConnection, session_id: str) -> Session | None:
    row = (
        (await conn.execute(_select_sessions().where(sessions.c.session_id == session_id)))
        .mappings()
        .first()
    )
    return None if row is None else codec.session_from_row(row)


# Message columns of an event row carry this prefix (``codec.event_from_row``).
_MESSAGE_PREFIX = "m_"


def _select_events() -> Select[Any]:
    """Session events, each joined with the message it stored (outer: most events
    store none)."""
    return select(
        session_events,
        *(column.label(_MESSAGE_PREFIX + column.name) for column in messages.c),
    ).select_from(
        session_events.outerjoin(
            messages,
            and_(
                messages.c.session_id == session_events.c.session_id,
                messages.c.sequence == session_events.c.sequence,
            ),
        )
    )


async def _event_at(conn: AsyncConnection, session_id: str, sequence: int) -> SessionEvent | None:
    stmt = _select_events().where(
        session_events.c.session_id == session_id, session_events.c.sequence == sequence
    )
    row = (await conn.execute(stmt)).mappings().first()
    return None if row is None else codec.event_from_row(row, _MESSAGE_PREFIX)


def _lease_expired(before: datetime) -> ColumnElement[bool]:
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
        conditions.append(_lease_expired(commit.lease_expired_before))
    values = _patch_values(commit.turn_patch, commit.now)
    if values:
        stmt: Any = update(turns).where(*conditions).values(values).returning(turns.c.turn_id)
    else:
        stmt = select(turns.c.turn_id).where(*conditions).with_for_update()
    return (await conn.execute(stmt)).first() is not None


def _patch_values(patch: TurnPatch | None, now: datetime) -> dict[str, Any]:
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


def _check_events(session_id: str, turn_id: str, events: Iterable[SessionEvent]) -> None:
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


def _utc(moment: datetime) -> datetime:
    """``moment`` in UTC; a naive datetime is refused (``ValueError``), since its zone
    would be a guess and leases compare these times across replicas."""
    if moment.tzinfo is None:
        raise ValueError(f"naive datetime {moment!r}: the store needs aware times")
    return moment.astimezone(UTC)


def _message_tokens(events: Iterable[SessionEvent]) -> int:
    return messages_tokens(event.message for event in events if event.message is not None)


def _numbered(events: Sequence[SessionEvent], last_sequence: int) -> list[SessionEvent]:
    first = last_sequence - len(events) + 1
    return [event.with_sequence(first + i) for i, event in enumerate(events)]


async def _insert_events(conn: AsyncConnection, numbered: Sequence[SessionEvent]) -> None:
    """One multi-row INSERT for the messages and one for the events."""
    message_rows = [codec.message_row(e.message) for e in numbered if e.message is not None]
    if message_rows:
        await conn.execute(insert(messages).values(message_rows))
    if numbered:
        await conn.execute(insert(session_events).values([codec.event_row(e) for e in numbered]))
