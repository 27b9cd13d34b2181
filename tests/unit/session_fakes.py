"""Small in-memory fakes for the session rules: a sessions-only store and a tracker.

Only what ``service.core.sessions`` uses is implemented; the rest of ``SessionStore``
belongs to the turn loop's fakes (tests/unit/fakes.py). The integration and service
tiers run the same rules on the SQL store.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from service.core.errors import InvalidArgument, NotFound
from service.core.model import Message, MessageKind, Session, Turn, TurnState
from service.core.ports import Acting, NewSession, ProjectInfo, SessionCursor, SessionQuery

START = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


class ManualClock:
    """A clock the test moves: ``now`` moves only by hand; ``monotonic`` is the machine's
    monotonic seconds plus every move, so deadlines the core waits for still pass."""

    def __init__(self) -> None:
        self.current = self._start = START

    def now(self) -> datetime:
        return self.current

    def monotonic(self) -> float:
        return time.monotonic() + (self.current - self._start).total_seconds()

    def advance(self, seconds: float) -> None:
        self.current += timedelta(seconds=seconds)


@dataclass
class MemorySessionStore:
    """Sessions, messages and turns in dictionaries, ordered like the SQL store."""

    sessions: dict[str, Session] = field(default_factory=dict)
    hashes: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    messages: dict[str, list[Message]] = field(default_factory=dict)
    turns: dict[str, Turn] = field(default_factory=dict)
    cancelled: list[str] = field(default_factory=list)
    list_calls: list[SessionQuery] = field(default_factory=list)

    async def ping(self) -> None:
        return None

    async def create_session(self, new: NewSession) -> Session:
        key = (new.owner_id, new.request_id)
        if key in self.hashes:
            session_id, request_hash = self.hashes[key]
            if request_hash != new.request_hash:
                raise InvalidArgument("request id reused", reason="REQUEST_ID_REUSED")
            return self.sessions[session_id]
        session = Session(
            session_id=new.session_id,
            project_id=new.project_id,
            organization_id=new.organization_id,
            owner_id=new.owner_id,
            title=new.title,
            create_time=new.now,
            update_time=new.now,
            create_request_id=new.request_id,
        )
        self.sessions[session.session_id] = session
        self.hashes[key] = (session.session_id, new.request_hash)
        return session

    async def get_session(self, session_id: str) -> Session | None:
        return self.sessions.get(session_id)

    async def list_sessions(
        self, query: SessionQuery
    ) -> tuple[list[Session], SessionCursor | None]:
        self.list_calls.append(query)
        matching = sorted(
            (
                s
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
        session = self.sessions.get(session_id)
        if session is None:
            return None
        updated = dataclasses.replace(session, title=title, update_time=now)
        self.sessions[session_id] = updated
        return updated

    async def delete_session(self, session_id: str) -> bool:
        self.messages.pop(session_id, None)
        return self.sessions.pop(session_id, None) is not None

    async def list_messages(
        self, session_id: str, after_sequence: int, limit: int
    ) -> list[Message]:
        return [m for m in self.messages.get(session_id, []) if m.sequence > after_sequence][:limit]

    async def get_turn(self, turn_id: str) -> Turn | None:
        return self.turns.get(turn_id)

    async def request_cancel(self, turn_id: str) -> Turn | None:
        self.cancelled.append(turn_id)
        return self.turns.get(turn_id)

    # -- helpers for tests ----------------------------------------------------------

    def add_messages(self, session_id: str, texts: list[str]) -> list[Message]:
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
        turn = Turn(
            turn_id=turn_id,
            session_id=session_id,
            human_id="alice",
            state=TurnState.RUNNING,
            start_time=START,
        )
        self.turns[turn_id] = turn
        return turn


@dataclass
class FakeTracker:
    """``ToolBackends.get_project``: which humans may read which projects, by org."""

    readable: dict[tuple[str, str], str] = field(default_factory=dict)
    calls: list[tuple[Acting, str]] = field(default_factory=list)

    def allow(self, human: str, project: str, organization: str = "acme") -> None:
        self.readable[(human, project)] = organization

    async def get_project(self, acting: Acting, project_id: str, timeout_s: float) -> ProjectInfo:
        self.calls.append((acting, project_id))
        organization = self.readable.get((acting.human_id, project_id))
        if organization is None:
            raise NotFound("no such project", reason="PROJECT_NOT_FOUND")
        return ProjectInfo(
            project_id=project_id,
            name=project_id.title(),
            description="",
            organization_id=organization,
            organization_name=organization.title(),
            planner_skill="",
            model_credential="cred",
        )

    async def read_skill(self, *args: object) -> object:
        raise NotImplementedError
