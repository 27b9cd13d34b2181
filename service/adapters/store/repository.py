"""``SqlSessionStore``: the core's ``SessionStore`` port on SQLAlchemy Core
(docs/spec/api-and-streams.md, docs/spec/turn-loop.md and docs/spec/storage.md).

One unit of work per method: a write runs in one ``engine.begin()`` transaction, a read on
a read-only connection (``engine.read_only``), never shared between tasks. Database errors
are translated in one place (``errors.translated``). A turn's units of work (open a turn,
commit its events) are ``turn_units.SqlTurnUnits``, which says how events are numbered and
what each costs; on PostgreSQL ``pg.PgSessionStore`` replaces them with server-side
functions (decision 0113). What the model sees of a session is kept between turns in a
``ContextCache`` that every unit of work here moves forward.

Cross-replica signals (PostgreSQL): no transaction here notifies (a ``NOTIFY`` in a
commit takes a cluster-wide lock, decision 0230). After a unit of work that stored events
has committed, ``signals`` (``signals.Signals``) announces the session's new last
sequence on the session's channel, off the caller's path; ``request_cancel`` announces the
turn on the cancel channel; ``delete_session`` announces the session deleted (and a
cancel for its running turn). ``service.adapters.bus.PgNotifier`` receives them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import Select, and_, delete, insert, or_, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.adapters.store import codec
from service.adapters.store import turn_units as units
from service.adapters.store.context_cache import ContextCache
from service.adapters.store.engine import is_postgresql, read_only
from service.adapters.store.errors import RequestIdTaken, translated
from service.adapters.store.signals import (
    CANCEL_CHANNEL,
    DELETED_SEQUENCE,
    Signals,
    notify_params,
    notify_sql,
)
from service.adapters.store.tables import (
    HAS_CREATE_REQUEST_ID,
    IS_RUNNING,
    messages,
    session_follows,
    sessions,
    turns,
)
from service.adapters.store.work import UnitsOfWork, every_method_a_unit_of_work, read_unit
from service.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    StoreConflict,
    StoreUnavailable,
)
from service.core.model import Message, Session, SessionEvent, Turn
from service.core.ports import (
    ContextSnapshot,
    LeaseStatus,
    NewSession,
    Promoted,
    Promotion,
    SessionCursor,
    SessionQuery,
    StartOutcomeKind,
    TurnCommit,
    TurnEnd,
    TurnStart,
    TurnStartOutcome,
)

#: Attempts to queue a message while the running turn ends between the start's refusal
#: and the queue's unit of work (each lost attempt started no turn and stored nothing).
_ENQUEUE_ATTEMPTS = 3

__all__ = ["CANCEL_CHANNEL", "DELETED_SEQUENCE", "SqlSessionStore", "engine_signals"]

#: The default bound of the context cache, in bytes (decision 0113).
CONTEXT_CACHE_BYTES = 64 << 20

# The session's running turn id, for ``Session.running_turn_id`` (NULL: none).
_RUNNING_TURN_ID = (
    select(turns.c.turn_id)
    .where(turns.c.session_id == sessions.c.session_id, IS_RUNNING)
    .scalar_subquery()
    .label("running_turn_id")
)


@every_method_a_unit_of_work
class SqlSessionStore:
    """Sessions, transcripts, turns and events in PostgreSQL or SQLite.

    ``engine`` comes from ``make_engine``; ``replica_id`` names this process in turn
    ownership and notifications (no spaces: the notification payload is space-separated).
    ``notify`` sends PostgreSQL notifications to other replicas, after a commit of events
    of a session another replica follows (``session_follows``, decision 0340), through
    ``signals`` (default: ``engine_signals`` on ``engine``); None means "when the engine
    is PostgreSQL" (SQLite serves one process and has no notifications).
    ``context_cache_bytes`` bounds the sessions' contexts kept between turns (0: none).
    Every public method is a unit of work of ``units_of_work`` (decision 0180).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        replica_id: str,
        notify: bool | None = None,
        *,
        context_cache_bytes: int = CONTEXT_CACHE_BYTES,
        units_of_work: UnitsOfWork | None = None,
        signals: Signals | None = None,
    ) -> None:
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
        #: The signals this store sends after its commits (None: it sends none).
        self.signals: Signals | None = None
        if notify:
            self.signals = signals or engine_signals(engine, replica_id)
        self._units = units.SqlTurnUnits()
        self._cache = ContextCache(context_cache_bytes)
        self.units_of_work = units_of_work or UnitsOfWork()

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

    @read_unit
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
        now = units.utc(new.now)
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
                await self._insert_session(row)
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

    async def _insert_session(self, row: dict[str, Any]) -> None:
        """Insert one ``sessions`` row (its columns by name); a taken request-id key
        raises ``RequestIdTaken``."""
        async with self._write() as conn:
            await conn.execute(insert(sessions).values(row))

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

    @read_unit
    async def get_session(self, session_id: str) -> Session | None:
        """The session, or None."""
        async with self._read() as conn:
            return await _session(conn, session_id)

    @read_unit
    async def list_sessions(
        self, query: SessionQuery
    ) -> tuple[list[Session], SessionCursor | None]:
        """One page of a project's sessions, newest first, ties by id descending
        (docs/spec/api-and-streams.md, AIP-158 keyset pagination), and the cursor of the next page
        (None: last page).

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
        self._cache.drop(session_id)
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
        one transaction (docs/spec/api-and-streams.md, ``DeleteSession``; the foreign keys cascade).
        False when it did not exist.

        With ``notify``, once it committed, other replicas hear ``'-1 <replica_id>'`` on
        the session's channel (their streams end with NOT_FOUND) and the running turn's
        id, if any, on the cancel channel (its owner stops it; its later commits
        conflict).
        """
        self._cache.drop(session_id)
        return await self._delete_session(session_id)

    def forget_sessions(self, session_ids: Sequence[str]) -> None:
        """Drop what this process keeps in memory of sessions deleted elsewhere (the
        retention job's batches), as ``delete_session`` does for its own."""
        for session_id in session_ids:
            self._cache.drop(session_id)

    async def _delete_session(self, session_id: str) -> bool:
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
        if self.signals is not None:
            self.signals.events(session_id, DELETED_SEQUENCE)
            for turn_id in running:
                self.signals.cancel(turn_id)
        return True

    # ------------------------------------------------------------------ transcript

    @read_unit
    async def list_messages(
        self, session_id: str, after_sequence: int, limit: int
    ) -> list[Message]:
        """Up to ``limit`` messages with a sequence above ``after_sequence``, in sequence
        order (docs/spec/api-and-streams.md, ``ListMessages``)."""
        stmt = (
            select(messages)
            .where(messages.c.session_id == session_id, messages.c.sequence > after_sequence)
            .order_by(messages.c.sequence)
            .limit(max(limit, 0))
        )
        async with self._read() as conn:
            rows = (await conn.execute(stmt)).mappings().all()
        return [codec.message_from_row(row) for row in rows]

    @read_unit
    async def events_after(
        self, session_id: str, after_sequence: int, limit: int
    ) -> list[SessionEvent]:
        """Up to ``limit`` session events with a sequence above ``after_sequence``, in
        order (docs/spec/api-and-streams.md, replay), each as it was stored: message events with
        their message (joined from ``messages`` on the same sequence), the others with their
        payload."""
        params = {
            "session_id": session_id,
            "after_sequence": after_sequence,
            "limit": max(limit, 0),
        }
        async with self._read() as conn:
            rows = (await conn.execute(units.EVENTS_AFTER, params)).mappings().all()
        return [codec.event_from_row(row, units.MESSAGE_PREFIX) for row in rows]

    @read_unit
    async def turn_messages(self, turn_id: str) -> list[Message]:
        """The messages of one turn, in sequence order."""
        stmt = select(messages).where(messages.c.turn_id == turn_id).order_by(messages.c.sequence)
        async with self._read() as conn:
            rows = (await conn.execute(stmt)).mappings().all()
        return [codec.message_from_row(row) for row in rows]

    def load_context(self, session_id: str) -> Awaitable[ContextSnapshot | None]:
        """The session and the messages after its summary's ``up_to``, in sequence order
        (docs/spec/compaction.md; T1: no message older than the summary is read). None when it is
        gone.

        Served from the context cache when this process's own units of work have kept
        it current (decision 0113): a finished future, no task and no connection (a turn
        starts its model call without yielding to the event loop); read from the
        database as a unit of work, and kept, otherwise.
        """
        cached = self._cache.get(session_id)
        if cached is not None:
            ready: asyncio.Future[ContextSnapshot | None] = (
                asyncio.get_running_loop().create_future()
            )
            ready.set_result(cached)
            return ready
        return self.units_of_work.run(self._load_context(session_id), read=True)

    def kept_context(self, session_id: str) -> ContextSnapshot | None:
        """The context cache's snapshot of the session (decision 0113), or None; no I/O."""
        return self._cache.get(session_id)

    async def _load_context(self, session_id: str) -> ContextSnapshot | None:
        snapshot = await self._read_context(session_id)
        if snapshot is None:
            return None
        self._cache.put(snapshot)
        return self._cache.get(session_id) or snapshot

    async def _read_context(self, session_id: str) -> ContextSnapshot | None:
        """``load_context`` from the database (a subclass may read it another way)."""
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

    @read_unit
    async def get_turn(self, turn_id: str) -> Turn | None:
        """The turn, or None."""
        async with self._read() as conn:
            row = (
                (await conn.execute(select(turns).where(turns.c.turn_id == turn_id)))
                .mappings()
                .first()
            )
        return None if row is None else codec.turn_from_row(row)

    @read_unit
    async def running_turns(
        self, *, owner: str | None = None, lease_expired_before: datetime | None = None
    ) -> list[Turn]:
        """Running turns, oldest first; only ``owner``'s, or only those whose lease
        expired before ``lease_expired_before`` (the sweeper, docs/spec/turn-loop.md), when
        given."""
        stmt = select(turns).where(IS_RUNNING)
        if owner is not None:
            stmt = stmt.where(turns.c.owner == owner)
        if lease_expired_before is not None:
            stmt = stmt.where(units.lease_expired(lease_expired_before))
        stmt = stmt.order_by(turns.c.start_time, turns.c.turn_id)
        async with self._read() as conn:
            rows = (await conn.execute(stmt)).mappings().all()
        return [codec.turn_from_row(row) for row in rows]

    async def start_turn(self, start: TurnStart) -> TurnStartOutcome:
        """Store the human message and open the turn, in one transaction
        (docs/spec/api-and-streams.md and docs/spec/turn-loop.md).

        The session row is locked first, then, in the port's order: the (session,
        request_id) duplicate check (same ``request_hash``: DUPLICATE with the original
        turn and its ``message_accepted`` event; another:
        ``InvalidArgument``/``REQUEST_ID_REUSED``); a running turn whose lease holds at
        ``start.now``: ``FailedPrecondition``/``TURN_IN_PROGRESS``, one whose lease
        expired: EXPIRED_TURN; the running-turn limits, counting turns whose lease holds
        (docs/spec/limits.md): ``ResourceExhausted``/``TOO_MANY_TURNS`` with ``retry_after_s``. A
        missing session raises ``NotFound``/``SESSION_NOT_FOUND``. Every outcome but
        STARTED stores nothing.

        ``start.events`` must include the event carrying ``start.message``; the stored
        turn's ``human_sequence`` is that event's sequence. Raises ``ValueError`` for
        malformed input (no request id, events of another session or turn, a naive
        ``now``).
        """
        human_index = units.checked_start(start)
        try:
            outcome, followed = await self._start_or_enqueue(start, human_index)
        except RequestIdTaken:
            # Lost a race for the request id (the session lock makes this unlikely): the
            # retry finds the winner and answers with a duplicate or REQUEST_ID_REUSED.
            outcome, followed = await self._start_or_enqueue(start, human_index)
        if outcome.kind is StartOutcomeKind.STARTED:
            if followed and self.signals is not None:
                self.signals.events(start.turn.session_id, outcome.events[-1].sequence)
            self._cache.advance(
                outcome.events,
                session_id=start.turn.session_id,
                last_sequence=outcome.events[-1].sequence,
                running_turn_id=start.turn.turn_id,
            )
        return outcome

    async def _start(self, start: TurnStart, human_index: int) -> tuple[TurnStartOutcome, bool]:
        """The unit of work of ``start_turn`` (a subclass may do it another way), and
        whether another replica follows the session (read in the same transaction when
        this store signals; decision 0340)."""
        try:
            async with self._write() as conn:
                outcome = await self._units.start_turn(conn, start, human_index)
                return outcome, await self._followed_elsewhere(conn, start.turn.session_id)
        except units.Undo as undo:
            return undo.outcome, False

    async def _followed_elsewhere(self, conn: AsyncConnection, session_id: str) -> bool:
        """Whether a replica other than this one follows ``session_id`` (one indexed read,
        only when this store signals: without signals nobody else is told anyway)."""
        if self.signals is None:
            return False
        row = (
            await conn.execute(
                select(session_follows.c.replica_id)
                .where(
                    session_follows.c.session_id == session_id,
                    session_follows.c.replica_id != self._replica_id,
                )
                .limit(1)
            )
        ).first()
        return row is not None

    async def _start_or_enqueue(
        self, start: TurnStart, human_index: int
    ) -> tuple[TurnStartOutcome, bool]:
        """``_start``; when a turn runs and ``start.enqueue`` is set, the message is
        queued instead, in a unit of work of its own that signals what it stored
        (decision 0300)."""
        for _attempt in range(_ENQUEUE_ATTEMPTS):
            try:
                return await self._start(start, human_index)
            except FailedPrecondition as busy:
                if start.enqueue is None or busy.reason != "TURN_IN_PROGRESS":
                    raise
            queued = await self._enqueue(start)
            if queued is not None:
                return queued, False
        raise units.turn_in_progress()

    async def _enqueue(self, start: TurnStart) -> TurnStartOutcome | None:
        """Store ``start`` as a queued turn (``SqlTurnUnits.enqueue``); None when the
        running turn ended meanwhile (start again). Keeps the context cache current; an
        INTERRUPT's cancel is signalled whoever follows the session (its owner may not)."""
        async with self._write() as conn:
            outcome = await self._units.enqueue(conn, start)
            followed = outcome is not None and await self._followed_elsewhere(
                conn, start.turn.session_id
            )
        if outcome is not None:
            event = outcome.events[0]
            if followed and self.signals is not None:
                self.signals.events(event.session_id, event.sequence)
            self._cache.advance(
                outcome.events, session_id=event.session_id, last_sequence=event.sequence
            )
            if outcome.interrupted is not None and self.signals is not None:
                self.signals.cancel(outcome.interrupted.turn_id)
            if outcome.join_into is not None and self.signals is not None:
                # The owner reads the turn on a cancel signal: join_pending, no cancel.
                self.signals.cancel(outcome.join_into.turn_id)
        return outcome

    async def commit(self, commit: TurnCommit) -> list[SessionEvent]:
        """Apply one ``TurnCommit`` in one transaction and return its events, numbered
        (docs/spec/turn-loop.md; T1: at most 4 per one-round turn).

        Conditions (``StoreConflict``, nothing stored, when one fails): the session exists,
        the turn exists in it and is RUNNING; ``owner``, when set, owns it;
        ``lease_expired_before``, when set, is after its lease's end. The session row is
        locked and updated: the counter (events), ``summary``, and the context estimate
        (``context``, or when None the stored messages' estimated tokens added to
        ``pending_tokens``). A ``turn_patch`` with ``end_reason`` ends the turn (state
        ENDED, ``end_time`` = ``commit.now``), which frees the session for the next.
        Raises ``ValueError`` for events of another session or turn, or a naive ``now``.
        """
        units.utc(commit.now)
        units.check_events(commit.session_id, commit.turn_id, commit.events)
        last, stored, followed = await self._commit(commit)
        if stored and followed and self.signals is not None:
            self.signals.events(commit.session_id, last)
        patch = commit.turn_patch
        self._cache.advance(
            stored,
            session_id=commit.session_id,
            last_sequence=last,
            turn_ended=patch is not None and patch.end_reason is not None,
            summary=commit.summary,
            context=commit.context,
        )
        return stored

    async def end_turn(self, commit: TurnCommit, promotion: Promotion) -> TurnEnd:
        """Apply the ending ``commit`` and start the session's first queued turn in the
        same transaction (decision 0300; the port has the rules). Raises as
        ``commit``."""
        units.utc(commit.now)
        units.utc(promotion.lease_expires_at)
        units.check_events(commit.session_id, commit.turn_id, commit.events)
        if commit.turn_patch is None or commit.turn_patch.end_reason is None:
            raise ValueError("end_turn needs a turn_patch with an end_reason")
        last, stored, promoted, followed = await self._end_turn(commit, promotion)
        if followed and self.signals is not None:
            self.signals.events(commit.session_id, last)
        ended_at = last if promoted is None else promoted.events[0].sequence - 1
        self._cache.advance(
            stored,
            session_id=commit.session_id,
            last_sequence=ended_at,
            turn_ended=True,
            summary=commit.summary,
            context=commit.context,
        )
        if promoted is not None:
            self._cache.advance(
                promoted.events,
                session_id=commit.session_id,
                last_sequence=last,
                running_turn_id=promoted.turn.turn_id,
            )
        return TurnEnd(stored, promoted)

    async def _end_turn(
        self, commit: TurnCommit, promotion: Promotion
    ) -> tuple[int, list[SessionEvent], Promoted | None, bool]:
        """The unit of work of ``end_turn``: the session's new last sequence, the
        ending's events numbered, the promoted turn, and whether another replica follows
        the session (a subclass may do it another way)."""
        async with self._write() as conn:
            stored = await self._units.commit(conn, commit)
            promoted = await self._units.promote(conn, commit.session_id, promotion, commit.now)
            followed = await self._followed_elsewhere(conn, commit.session_id)
            if promoted is not None:
                return promoted.events[-1].sequence, stored, promoted, followed
            last = await self._last_sequence(conn, commit.session_id, stored)
        return last, stored, None, followed

    async def join_queued(
        self, session_id: str, turn_id: str, owner: str, now: datetime
    ) -> list[SessionEvent]:
        """Take the session's queued JOIN messages into running turn ``turn_id``
        (decision 0303; the port has the rules)."""
        units.utc(now)
        async with self._write() as conn:
            stored = await self._units.join_queued(conn, session_id, turn_id, owner, now)
            followed = bool(stored) and await self._followed_elsewhere(conn, session_id)
        if stored:
            if followed and self.signals is not None:
                self.signals.events(session_id, stored[-1].sequence)
            self._cache.advance(stored, session_id=session_id, last_sequence=stored[-1].sequence)
        return stored

    async def cancel_queued(self, turn_id: str, event: SessionEvent) -> list[SessionEvent]:
        """End a QUEUED turn CANCELLED without running it (decision 0300; the port has
        the rules)."""
        units.check_events(event.session_id, turn_id, [event])
        try:
            async with self._write() as conn:
                stored = await self._units.cancel_queued(conn, turn_id, event)
                followed = await self._followed_elsewhere(conn, event.session_id)
        except units.Undone:
            return []
        if stored:
            if followed and self.signals is not None:
                self.signals.events(event.session_id, stored[-1].sequence)
            self._cache.advance(
                stored, session_id=event.session_id, last_sequence=stored[-1].sequence
            )
        return stored

    async def _commit(self, commit: TurnCommit) -> tuple[int, list[SessionEvent], bool]:
        """The unit of work of ``commit``: the session's new last sequence, the events
        numbered, and whether another replica follows the session (a subclass may do it
        another way)."""
        async with self._write() as conn:
            stored = await self._units.commit(conn, commit)
            last = await self._last_sequence(conn, commit.session_id, stored)
            followed = bool(stored) and await self._followed_elsewhere(conn, commit.session_id)
        return last, stored, followed

    @staticmethod
    async def _last_sequence(
        conn: AsyncConnection, session_id: str, stored: Sequence[SessionEvent]
    ) -> int:
        if stored:
            return stored[-1].sequence
        row = (
            await conn.execute(
                select(sessions.c.last_sequence).where(sessions.c.session_id == session_id)
            )
        ).first()
        return 0 if row is None else int(row.last_sequence)

    async def renew_lease(self, turn_id: str, owner: str, until: datetime) -> LeaseStatus:
        """Extend the lease of a running turn ``owner`` holds to ``until`` (docs/spec/turn-loop.md).

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
                    .returning(
                        turns.c.cancel_requested, turns.c.cancel_reason, turns.c.join_pending
                    )
                )
            ).first()
        if row is None:
            return LeaseStatus(held=False)
        return LeaseStatus(
            held=True,
            cancel_requested=bool(row.cancel_requested),
            cancel_reason=str(row.cancel_reason),
            join_pending=bool(row.join_pending),
        )

    async def request_cancel(self, turn_id: str) -> Turn | None:
        """Flag a running turn cancelled and, with ``notify``, once that committed, send
        its id on the cancel channel (docs/spec/api-and-streams.md, ``CancelTurn``: the
        owner, on any replica, stops it within 1 s; a lost signal is caught by the owner's
        next lease renewal). Returns the turn as stored: an ended turn unchanged, None for
        an unknown one."""
        stmt = (
            update(turns)
            .where(turns.c.turn_id == turn_id, IS_RUNNING)
            .values(cancel_requested=True)
            .returning(*turns.c)
        )
        async with self._write() as conn:
            row = (await conn.execute(stmt)).mappings().first()
            flagged = row is not None
            if row is None:
                row = (
                    (await conn.execute(select(turns).where(turns.c.turn_id == turn_id)))
                    .mappings()
                    .first()
                )
        if flagged and self.signals is not None:
            self.signals.cancel(turn_id)
        return None if row is None else codec.turn_from_row(row)


# ---------------------------------------------------------------------- module helpers


def engine_signals(engine: AsyncEngine, replica_id: str) -> Signals:
    """``Signals`` of replica ``replica_id`` sent on connections of ``engine``'s pool."""

    async def send(signals: Sequence[tuple[str, str]], lock_timeout_s: float) -> None:
        with translated():
            async with engine.connect() as conn:
                await conn.exec_driver_sql(
                    notify_sql(len(signals)), tuple(notify_params(signals, lock_timeout_s))
                )
                await conn.commit()

    return Signals(send, replica_id)


def _select_sessions() -> Select[Any]:
    return select(sessions, _RUNNING_TURN_ID)


async def _session(conn: AsyncConnection, session_id: str) -> Session | None:
    row = (
        (await conn.execute(_select_sessions().where(sessions.c.session_id == session_id)))
        .mappings()
        .first()
    )
    return None if row is None else codec.session_from_row(row)
