"""The one in-memory ``SessionStore`` for tests that need a fake store.

It keeps the port's contract (``service/core/ports/store.py``): the integration tier runs
the same contract tests on it as on SQLite and PostgreSQL
(``tests/integration/test_store_repository.py``), so a unit test on it sees what the
turn loop and the session rules would see on a database. Each method is one step of the
event loop (it yields once, as a round trip would) and changes nothing when it raises.

Besides the port it offers what tests arrange or observe: ``add_session``,
``add_messages``, ``add_turn``, ``commits`` (units of work that wrote), ``fail`` (every
commit raises ``StoreUnavailable``), ``cancelled`` (turn ids asked to cancel) and
``list_calls`` (every ``SessionQuery`` seen).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from service.adapters.store.codec import queued_message_json
from service.adapters.store.turn_units import (
    check_events,
    checked_start,
    joined_events,
    promoted_turn,
    promotion_events,
    queue_place,
    queued_event,
    queued_turn,
    too_many_turns,
    turn_in_progress,
    utc,
)
from service.core.errors import (
    InvalidArgument,
    NotFound,
    StoreConflict,
    StoreUnavailable,
)
from service.core.estimate import message_tokens
from service.core.model import (
    ContextEstimate,
    Message,
    MessageKind,
    OnBusy,
    Session,
    SessionEvent,
    Turn,
    TurnEndReason,
    TurnState,
)
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

#: When the test helpers date what they add.
START = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@dataclass
class MemoryStore:
    """Sessions, messages, events and turns in dictionaries, ordered like the SQL store."""

    sessions: dict[str, Session] = field(default_factory=dict)
    messages: dict[str, list[Message]] = field(default_factory=dict)
    events: dict[str, list[SessionEvent]] = field(default_factory=dict)
    turns: dict[str, Turn] = field(default_factory=dict)
    #: (owner, request_id) -> (session_id, request_hash) of every create.
    hashes: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    commits: int = 0
    fail: bool = False
    #: Set when a commit failed because of ``fail``.
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: list[str] = field(default_factory=list)
    list_calls: list[SessionQuery] = field(default_factory=list)
    #: Queued turns: turn_id -> (message as JSON, token, queue priority).
    queued: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    #: The queued turns sent with JOIN.
    joins: set[str] = field(default_factory=set)

    # ------------------------------------------------------------------ sessions

    async def ping(self) -> None:
        await asyncio.sleep(0)

    async def create_session(self, new: NewSession) -> Session:
        await asyncio.sleep(0)
        key = (new.owner_id, new.request_id)
        if new.request_id and key in self.hashes:
            session_id, request_hash = self.hashes[key]
            if request_hash != new.request_hash:
                raise InvalidArgument("request id reused", reason="REQUEST_ID_REUSED")
            return self._session(session_id)
        session = self.add_session(
            Session(
                session_id=new.session_id,
                project_id=new.project_id,
                organization_id=new.organization_id,
                owner_id=new.owner_id,
                title=new.title,
                create_time=utc(new.now),
                update_time=utc(new.now),
                create_request_id=new.request_id,
            )
        )
        if new.request_id:
            self.hashes[key] = (session.session_id, new.request_hash)
        return session

    async def get_session(self, session_id: str) -> Session | None:
        await asyncio.sleep(0)
        return self._session(session_id) if session_id in self.sessions else None

    async def list_sessions(
        self, query: SessionQuery
    ) -> tuple[list[Session], SessionCursor | None]:
        await asyncio.sleep(0)
        self.list_calls.append(query)
        matching = sorted(
            (
                self._session(s.session_id)
                for s in self.sessions.values()
                if s.project_id == query.project_id
                and s.organization_id == query.organization_id
                and (query.owner_id is None or s.owner_id == query.owner_id)
            ),
            key=lambda s: (s.create_time, s.session_id),
            reverse=True,
        )
        if query.after is not None:
            after = (query.after.create_time, query.after.session_id)
            matching = [s for s in matching if (s.create_time, s.session_id) < after]
        page = matching[: query.page_size]
        more = len(matching) > query.page_size
        cursor = SessionCursor(page[-1].create_time, page[-1].session_id) if more else None
        return page, cursor

    async def update_session_title(
        self, session_id: str, title: str, now: datetime
    ) -> Session | None:
        await asyncio.sleep(0)
        if session_id not in self.sessions:
            return None
        self.sessions[session_id] = replace(
            self.sessions[session_id], title=title, update_time=utc(now)
        )
        return self._session(session_id)

    async def delete_session(self, session_id: str) -> bool:
        await asyncio.sleep(0)
        if self.sessions.pop(session_id, None) is None:
            return False
        self.messages.pop(session_id, None)
        self.events.pop(session_id, None)
        self.turns = {k: t for k, t in self.turns.items() if t.session_id != session_id}
        self.queued = {k: q for k, q in self.queued.items() if k in self.turns}
        self.hashes = {k: v for k, v in self.hashes.items() if v[0] != session_id}
        return True

    async def list_messages(
        self, session_id: str, after_sequence: int, limit: int
    ) -> list[Message]:
        await asyncio.sleep(0)
        kept = self.messages.get(session_id, [])
        return [m for m in kept if m.sequence > after_sequence][:limit]

    async def events_after(
        self, session_id: str, after_sequence: int, limit: int
    ) -> list[SessionEvent]:
        await asyncio.sleep(0)
        kept = self.events.get(session_id, [])
        return [e for e in kept if e.sequence > after_sequence][:limit]

    async def load_context(self, session_id: str) -> ContextSnapshot | None:
        await asyncio.sleep(0)
        return self.kept_context(session_id)

    def kept_context(self, session_id: str) -> ContextSnapshot | None:
        if session_id not in self.sessions:
            return None
        session = self._session(session_id)
        kept = [m for m in self.messages[session_id] if m.sequence > session.summary_up_to]
        return ContextSnapshot(session, kept)

    # ------------------------------------------------------------------ turns

    async def get_turn(self, turn_id: str) -> Turn | None:
        await asyncio.sleep(0)
        return self.turns.get(turn_id)

    async def turn_messages(self, turn_id: str) -> list[Message]:
        await asyncio.sleep(0)
        found = [m for ms in self.messages.values() for m in ms if m.turn_id == turn_id]
        return sorted(found, key=lambda m: m.sequence)

    async def start_turn(self, start: TurnStart) -> TurnStartOutcome:
        await asyncio.sleep(0)
        checked_start(start)
        session_id = start.turn.session_id
        if session_id not in self.sessions:
            raise NotFound("the session does not exist", reason="SESSION_NOT_FOUND")
        for turn in self.turns.values():
            if turn.session_id == session_id and turn.request_id == start.turn.request_id:
                if turn.request_hash != start.turn.request_hash:
                    raise InvalidArgument("request id reused", reason="REQUEST_ID_REUSED")
                accepted = [
                    e
                    for e in self.events[session_id]
                    if e.turn_id == turn.turn_id and e.sequence == turn.human_sequence
                ]
                return TurnStartOutcome(StartOutcomeKind.DUPLICATE, turn, accepted[:1])
        running = [t for t in self.turns.values() if t.state is TurnState.RUNNING]
        for turn in running:
            if turn.session_id == session_id:
                if turn.lease_expires_at is not None and turn.lease_expires_at > start.now:
                    if start.enqueue is not None:
                        return self._enqueue(start, turn)
                    raise turn_in_progress()
                return TurnStartOutcome(StartOutcomeKind.EXPIRED_TURN, turn)
        # Only turns whose lease holds count against the limits.
        held = [t for t in running if t.lease_expires_at and t.lease_expires_at > start.now]
        if sum(1 for t in held if t.human_id == start.turn.human_id) >= start.limits.per_human:
            raise too_many_turns("human", start.limits)
        in_project = [t for t in held if self.sessions[t.session_id].project_id == start.project_id]
        if len(in_project) >= start.limits.per_project:
            raise too_many_turns("project", start.limits)
        stored = self._append(session_id, start.events, None)
        human = next(e.message for e in stored if e.message is not None)
        turn = replace(start.turn, human_sequence=human.sequence)
        self.turns[turn.turn_id] = turn
        self.commits += 1
        return TurnStartOutcome(StartOutcomeKind.STARTED, turn, stored)

    async def commit(self, commit: TurnCommit) -> list[SessionEvent]:
        await asyncio.sleep(0)
        utc(commit.now)
        check_events(commit.session_id, commit.turn_id, commit.events)
        if self.fail:
            self.failed.set()
            raise StoreUnavailable("the database is unreachable")
        turn = self.turns.get(commit.turn_id)
        if turn is None or turn.session_id != commit.session_id:
            raise StoreConflict("the turn is not this session's")
        if turn.state is not TurnState.RUNNING:
            raise StoreConflict("the turn has ended")
        if commit.owner is not None and turn.owner != commit.owner:
            raise StoreConflict("another replica owns the turn")
        if commit.lease_expired_before is not None and (
            turn.lease_expires_at is None or turn.lease_expires_at >= commit.lease_expired_before
        ):
            raise StoreConflict("the turn's lease holds")
        stored = self._append(commit.session_id, commit.events, commit.context)
        if commit.summary is not None:
            self.sessions[commit.session_id] = replace(
                self.sessions[commit.session_id],
                summary=commit.summary.summary,
                summary_up_to=commit.summary.up_to,
                update_time=utc(commit.now),
            )
        if commit.turn_patch is not None:
            patch = commit.turn_patch
            # A patch's fields are the turn's, named alike; None leaves one unchanged.
            changes: dict[str, Any] = {
                f.name: getattr(patch, f.name)
                for f in dataclasses.fields(patch)
                if f.name != "end_reason" and getattr(patch, f.name) is not None
            }
            if patch.end_reason is not None:
                changes.update(
                    state=TurnState.ENDED, end_reason=patch.end_reason, end_time=commit.now
                )
            self.turns[commit.turn_id] = replace(turn, **changes)
        self.commits += 1
        return stored

    async def end_turn(self, commit: TurnCommit, promotion: Promotion) -> TurnEnd:
        if commit.turn_patch is None or commit.turn_patch.end_reason is None:
            raise ValueError("end_turn needs a turn_patch with an end_reason")
        utc(promotion.lease_expires_at)
        stored = await self.commit(commit)
        waiting = sorted(
            (
                t
                for t in self.turns.values()
                if t.session_id == commit.session_id and t.state is TurnState.QUEUED
            ),
            key=lambda t: (-self.queued[t.turn_id][2], t.human_sequence),
        )
        if not waiting:
            return TurnEnd(stored)
        queued = waiting[0]
        message_json, token, _priority = self.queued.pop(queued.turn_id)
        self.joins.discard(queued.turn_id)
        now = utc(commit.now)
        events = self._append(
            commit.session_id,
            promotion_events(queued.turn_id, commit.session_id, message_json, promotion, now),
            None,
        )
        turn = promoted_turn(queued, promotion, now, events[0].sequence)
        self.turns[turn.turn_id] = turn
        return TurnEnd(stored, Promoted(turn, events, token))

    async def join_queued(
        self, session_id: str, turn_id: str, owner: str, now: datetime
    ) -> list[SessionEvent]:
        await asyncio.sleep(0)
        utc(now)
        if self.fail:
            raise StoreUnavailable("the database is unreachable")
        running = self.turns.get(turn_id)
        if (
            running is None
            or running.session_id != session_id
            or running.state is not TurnState.RUNNING
            or running.owner != owner
        ):
            raise StoreConflict("the turn is not this replica's running turn")
        self.turns[turn_id] = replace(running, join_pending=False)
        joining = sorted(
            (
                t
                for t in self.turns.values()
                if t.session_id == session_id
                and t.state is TurnState.QUEUED
                and t.turn_id in self.joins
            ),
            key=lambda t: t.human_sequence,
        )
        if not joining:
            return []
        events = joined_events(
            session_id, turn_id, [(t.turn_id, self.queued[t.turn_id][0]) for t in joining], now
        )
        for queued in joining:
            self.queued.pop(queued.turn_id, None)
            self.joins.discard(queued.turn_id)
            self.turns[queued.turn_id] = replace(
                queued,
                state=TurnState.ENDED,
                end_reason=TurnEndReason.JOINED,
                end_time=now,
                queued_text="",
            )
        self.commits += 1
        return self._append(session_id, events, None)

    async def cancel_queued(self, turn_id: str, event: SessionEvent) -> list[SessionEvent]:
        await asyncio.sleep(0)
        check_events(event.session_id, turn_id, [event])
        turn = self.turns.get(turn_id)
        if turn is None or turn.state is not TurnState.QUEUED:
            return []
        self.queued.pop(turn_id, None)
        self.joins.discard(turn_id)
        self.turns[turn_id] = replace(
            turn,
            state=TurnState.ENDED,
            end_reason=TurnEndReason.CANCELLED,
            end_time=event.create_time,
            queued_text="",
        )
        self.commits += 1
        return self._append(event.session_id, [event], None)

    async def renew_lease(self, turn_id: str, owner: str, until: datetime) -> LeaseStatus:
        await asyncio.sleep(0)
        turn = self.turns.get(turn_id)
        if turn is None or turn.state is not TurnState.RUNNING or turn.owner != owner:
            return LeaseStatus(held=False)
        self.turns[turn_id] = replace(turn, lease_expires_at=utc(until))
        return LeaseStatus(
            held=True,
            cancel_requested=turn.cancel_requested,
            cancel_reason=turn.cancel_reason,
            join_pending=turn.join_pending,
        )

    async def request_cancel(self, turn_id: str) -> Turn | None:
        await asyncio.sleep(0)
        self.cancelled.append(turn_id)
        turn = self.turns.get(turn_id)
        if turn is not None and turn.state is TurnState.RUNNING:
            turn = replace(turn, cancel_requested=True)
            self.turns[turn_id] = turn
        return turn

    async def running_turns(
        self, *, owner: str | None = None, lease_expired_before: datetime | None = None
    ) -> list[Turn]:
        await asyncio.sleep(0)
        return [
            t
            for t in self.turns.values()
            if t.state is TurnState.RUNNING
            and (owner is None or t.owner == owner)
            and (
                lease_expired_before is None
                or (t.lease_expires_at is not None and t.lease_expires_at < lease_expired_before)
            )
        ]

    # ------------------------------------------------------------------ test helpers

    def add_session(self, session: Session) -> Session:
        """Store ``session`` as it is (no idempotency key)."""
        self.sessions[session.session_id] = session
        self.messages.setdefault(session.session_id, [])
        self.events.setdefault(session.session_id, [])
        return session

    def add_messages(self, session_id: str, texts: Iterable[str]) -> list[Message]:
        """Append human messages of ``alice`` in turn ``turn-1``, numbered from 1 on."""
        existing = self.messages.setdefault(session_id, [])
        for text in texts:
            existing.append(
                Message(
                    session_id=session_id,
                    turn_id="turn-1",
                    message_id=f"m{len(existing) + 1}",
                    kind=MessageKind.HUMAN,
                    create_time=START,
                    sequence=len(existing) + 1,
                    text=text,
                    human_id="alice",
                )
            )
        return existing

    def add_turn(self, session_id: str, turn_id: str) -> Turn:
        """A running turn of ``alice`` without a lease."""
        turn = Turn(
            turn_id=turn_id,
            session_id=session_id,
            human_id="alice",
            state=TurnState.RUNNING,
            start_time=START,
        )
        self.turns[turn_id] = turn
        return turn

    # ------------------------------------------------------------------ internals

    def _enqueue(self, start: TurnStart, running: Turn) -> TurnStartOutcome:
        enqueue = start.enqueue
        assert enqueue is not None
        session_id = start.turn.session_id
        priority, behind = queue_place(
            enqueue,
            running.turn_id,
            [
                (t.turn_id, self.queued[t.turn_id][2], t.human_sequence)
                for t in self.turns.values()
                if t.session_id == session_id and t.state is TurnState.QUEUED
            ],
        )
        (event,) = self._append(session_id, [queued_event(enqueue, behind)], None)
        turn = queued_turn(start, event.sequence, behind)
        self.turns[turn.turn_id] = turn
        self.queued[turn.turn_id] = (queued_message_json(start.message), enqueue.token, priority)
        if enqueue.on_busy is OnBusy.JOIN:
            self.joins.add(turn.turn_id)
            running = replace(running, join_pending=True)
            self.turns[running.turn_id] = running
        interrupted = None
        if enqueue.on_busy is OnBusy.INTERRUPT:
            interrupted = replace(
                running, cancel_requested=True, cancel_reason="interrupted_by_message"
            )
            self.turns[running.turn_id] = interrupted
        self.commits += 1
        join_into = running if enqueue.on_busy is OnBusy.JOIN else None
        return TurnStartOutcome(
            StartOutcomeKind.QUEUED, turn, [event], interrupted, join_into=join_into
        )

    def _session(self, session_id: str) -> Session:
        running = next(
            (
                t.turn_id
                for t in self.turns.values()
                if t.session_id == session_id and t.state is TurnState.RUNNING
            ),
            "",
        )
        return replace(self.sessions[session_id], running_turn_id=running)

    def _append(
        self, session_id: str, events: Iterable[SessionEvent], context: ContextEstimate | None
    ) -> list[SessionEvent]:
        session = self.sessions[session_id]
        sequence = session.last_sequence
        stored: list[SessionEvent] = []
        added = 0
        for event in events:
            sequence += 1
            numbered = event.with_sequence(sequence)
            stored.append(numbered)
            self.events.setdefault(session_id, []).append(numbered)
            if numbered.message is not None:
                self.messages.setdefault(session_id, []).append(numbered.message)
                added += message_tokens(numbered.message)
        estimate = context or replace(
            session.context, pending_tokens=session.context.pending_tokens + added
        )
        self.sessions[session_id] = replace(session, last_sequence=sequence, context=estimate)
        return stored
