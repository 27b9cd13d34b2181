"""Hand-written in-memory fakes of the core's ports, for unit tests of the turn loop.

They follow the port docstrings (service/core/ports/) closely enough that the turn
runner cannot tell them from the real adapters; the integration and service tiers run
the same scenarios on the real ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from service.core.backend_types import (
    Changeset,
    ChangesetPage,
    ChangesetProposal,
    ChangesetQuery,
    ChangesetStatus,
    Item,
    ItemKind,
    ItemPage,
    ItemQuery,
    ItemState,
    KnowledgeEntry,
    KnowledgeEntryChange,
    KnowledgeHits,
    KnowledgeKind,
    KnowledgeSearch,
    NewKnowledgeEntry,
    ProjectSearch,
    ProjectSearchResult,
    RunnableQuery,
    Skill,
    SkillContent,
    SkillPage,
    SkillQuery,
    SkillScope,
)
from service.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    ModelFailure,
    NotFound,
    ResourceExhausted,
    StoreConflict,
    ToolFailure,
)
from service.core.estimate import message_tokens
from service.core.model import (
    ContextEstimate,
    EventKind,
    Message,
    Session,
    SessionEvent,
    Turn,
    TurnState,
    Usage,
)
from service.core.ports import (
    Acting,
    ContextSnapshot,
    FinishChunk,
    FinishReason,
    LeaseStatus,
    ModelChunk,
    ModelRequest,
    NewSession,
    ProjectInfo,
    Role,
    SessionCursor,
    SessionQuery,
    SkillDocument,
    StartOutcomeKind,
    TextChunk,
    ToolCall,
    ToolCallChunk,
    ToolCallStartChunk,
    TurnCommit,
    TurnStart,
    TurnStartOutcome,
)


class FakeClock:
    """A clock the test moves: ``now`` moves only by hand; ``monotonic`` is the machine's
    monotonic seconds plus every move, so deadlines the core waits for still pass."""

    def __init__(self) -> None:
        self.current = self._start = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)

    def now(self) -> datetime:
        return self.current

    def monotonic(self) -> float:
        return time.monotonic() + (self.current - self._start).total_seconds()

    def advance(self, seconds: float) -> None:
        self.current += timedelta(seconds=seconds)


@dataclass
class FakeStore:
    """An in-memory ``SessionStore``; counts commits like the real one makes them."""

    sessions: dict[str, Session] = field(default_factory=dict)
    messages: dict[str, list[Message]] = field(default_factory=dict)
    events: dict[str, list[SessionEvent]] = field(default_factory=dict)
    turns: dict[str, Turn] = field(default_factory=dict)
    commits: int = 0
    fail: bool = False

    def add_session(self, session: Session) -> Session:
        self.sessions[session.session_id] = session
        self.messages[session.session_id] = []
        self.events[session.session_id] = []
        return session

    async def ping(self) -> None:
        return None

    async def create_session(self, new: NewSession) -> Session:
        return self.add_session(
            Session(
                session_id=new.session_id,
                project_id=new.project_id,
                organization_id=new.organization_id,
                owner_id=new.owner_id,
                title=new.title,
                create_time=new.now,
                update_time=new.now,
                create_request_id=new.request_id,
            )
        )

    async def get_session(self, session_id: str) -> Session | None:
        session = self.sessions.get(session_id)
        if session is None:
            return None
        running = next(
            (
                t.turn_id
                for t in self.turns.values()
                if t.session_id == session_id and t.state is TurnState.RUNNING
            ),
            "",
        )
        return replace(session, running_turn_id=running)

    async def list_sessions(
        self, query: SessionQuery
    ) -> tuple[list[Session], SessionCursor | None]:
        raise NotImplementedError

    async def update_session_title(
        self, session_id: str, title: str, now: datetime
    ) -> Session | None:
        raise NotImplementedError

    async def delete_session(self, session_id: str) -> bool:
        raise NotImplementedError

    async def list_messages(
        self, session_id: str, after_sequence: int, limit: int
    ) -> list[Message]:
        return [m for m in self.messages[session_id] if m.sequence > after_sequence][:limit]

    async def events_after(
        self, session_id: str, after_sequence: int, limit: int
    ) -> list[SessionEvent]:
        return [e for e in self.events[session_id] if e.sequence > after_sequence][:limit]

    async def get_turn(self, turn_id: str) -> Turn | None:
        return self.turns.get(turn_id)

    async def turn_messages(self, turn_id: str) -> list[Message]:
        return [m for ms in self.messages.values() for m in ms if m.turn_id == turn_id]

    async def load_context(self, session_id: str) -> ContextSnapshot | None:
        session = self.sessions.get(session_id)
        if session is None:
            return None
        kept = [m for m in self.messages[session_id] if m.sequence > session.summary_up_to]
        return ContextSnapshot(session, kept)

    async def start_turn(self, start: TurnStart) -> TurnStartOutcome:
        await asyncio.sleep(0)
        session_id = start.turn.session_id
        if session_id not in self.sessions:
            raise NotFound("no session", reason="SESSION_NOT_FOUND")
        for turn in self.turns.values():
            if turn.session_id == session_id and turn.request_id == start.turn.request_id:
                if turn.request_hash != start.turn.request_hash:
                    raise InvalidArgument("reused", reason="REQUEST_ID_REUSED")
                accepted = next(
                    e
                    for e in self.events[session_id]
                    if e.turn_id == turn.turn_id and e.kind is EventKind.MESSAGE_ACCEPTED
                )
                return TurnStartOutcome(StartOutcomeKind.DUPLICATE, turn, [accepted])
        for turn in self.turns.values():
            if turn.session_id == session_id and turn.state is TurnState.RUNNING:
                assert turn.lease_expires_at is not None
                if turn.lease_expires_at > start.now:
                    raise FailedPrecondition("busy", reason="TURN_IN_PROGRESS")
                return TurnStartOutcome(StartOutcomeKind.EXPIRED_TURN, turn)
        running = [t for t in self.turns.values() if t.state is TurnState.RUNNING]
        if sum(1 for t in running if t.human_id == start.turn.human_id) >= start.limits.per_human:
            raise ResourceExhausted("too many", reason="TOO_MANY_TURNS", retry_after_s=1.0)
        self.turns[start.turn.turn_id] = start.turn
        stored = self._append(session_id, start.events, None)
        human = stored[0].message
        assert human is not None
        self.turns[start.turn.turn_id] = replace(start.turn, human_sequence=human.sequence)
        self.commits += 1
        return TurnStartOutcome(StartOutcomeKind.STARTED, self.turns[start.turn.turn_id], stored)

    async def commit(self, commit: TurnCommit) -> list[SessionEvent]:
        await asyncio.sleep(0)
        turn = self.turns[commit.turn_id]
        if self.fail:
            from service.core.errors import StoreUnavailable

            raise StoreUnavailable("down")
        if turn.state is not TurnState.RUNNING:
            raise StoreConflict("ended")
        if commit.owner is not None and turn.owner != commit.owner:
            raise StoreConflict("owner")
        if commit.lease_expired_before is not None:
            assert turn.lease_expires_at is not None
            if turn.lease_expires_at >= commit.lease_expired_before:
                raise StoreConflict("lease holds")
        stored = self._append(commit.session_id, commit.events, commit.context)
        session = self.sessions[commit.session_id]
        if commit.summary is not None:
            session = replace(
                session, summary=commit.summary.summary, summary_up_to=commit.summary.up_to
            )
        self.sessions[commit.session_id] = session
        if commit.turn_patch is not None:
            values = {
                k: v for k, v in dataclasses.asdict(commit.turn_patch).items() if v is not None
            }
            patch = commit.turn_patch
            changes: dict[str, Any] = {}
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
                if name in values:
                    changes[name] = values[name]
            if patch.usage is not None:
                changes["usage"] = patch.usage
            if patch.compaction_usage is not None:
                changes["compaction_usage"] = patch.compaction_usage
            if patch.end_reason is not None:
                changes.update(
                    state=TurnState.ENDED, end_reason=patch.end_reason, end_time=commit.now
                )
            turn = replace(turn, **changes)
            self.turns[commit.turn_id] = turn
        self.commits += 1
        return stored

    def _append(
        self, session_id: str, events: Any, context: ContextEstimate | None
    ) -> list[SessionEvent]:
        session = self.sessions[session_id]
        sequence = session.last_sequence
        stored: list[SessionEvent] = []
        added = 0
        for event in events:
            sequence += 1
            numbered = event.with_sequence(sequence)
            stored.append(numbered)
            self.events[session_id].append(numbered)
            if numbered.message is not None:
                self.messages[session_id].append(numbered.message)
                added += message_tokens(numbered.message)
        estimate = context or replace(
            session.context, pending_tokens=session.context.pending_tokens + added
        )
        self.sessions[session_id] = replace(session, last_sequence=sequence, context=estimate)
        return stored

    async def renew_lease(self, turn_id: str, owner: str, until: datetime) -> LeaseStatus:
        turn = self.turns[turn_id]
        if turn.state is not TurnState.RUNNING or turn.owner != owner:
            return LeaseStatus(held=False)
        self.turns[turn_id] = replace(turn, lease_expires_at=until)
        return LeaseStatus(held=True, cancel_requested=turn.cancel_requested)

    async def request_cancel(self, turn_id: str) -> Turn | None:
        turn = self.turns.get(turn_id)
        if turn is None:
            return None
        if turn.state is TurnState.RUNNING:
            turn = replace(turn, cancel_requested=True)
            self.turns[turn_id] = turn
        return turn

    async def running_turns(
        self, *, owner: str | None = None, lease_expired_before: datetime | None = None
    ) -> list[Turn]:
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


Reply = dict[str, Any]


class ScriptedGateway:
    """A ``ModelGateway`` answering from a function of the request; records requests.

    ``script(request)`` returns a reply dict: ``text``, ``chunks`` (list of text pieces),
    ``tool_calls`` (``[(name, arguments_text)]``), ``usage`` (``(input, output)``),
    ``error`` (a ``ModelFailure``), ``error_after`` (deltas before it), ``block`` (an
    ``asyncio.Event`` to wait for before finishing), ``ids`` (the provider's id of each
    call; default unique ones), ``finish`` (a ``FinishReason``).
    """

    def __init__(self, script: Callable[[ModelRequest], Reply]) -> None:
        self.script = script
        self.requests: list[ModelRequest] = []
        self.started = asyncio.Event()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelChunk]:
        self.requests.append(request)
        reply = self.script(request)
        chunks = reply.get("chunks") or ([reply["text"]] if reply.get("text") else [])
        error: ModelFailure | None = reply.get("error")
        error_after = reply.get("error_after", 0 if error else None)
        for index, piece in enumerate(chunks):
            if error is not None and error_after is not None and index >= error_after:
                raise error
            yield TextChunk(piece)
            self.started.set()
            await asyncio.sleep(0)
        if error is not None:
            raise error
        block: asyncio.Event | None = reply.get("block")
        self.started.set()
        if block is not None:
            await block.wait()
        ids = reply.get("ids")
        for number, (name, arguments) in enumerate(reply.get("tool_calls", [])):
            call_id = ids[number] if ids is not None else f"call_{len(self.requests)}_{number}"
            yield ToolCallStartChunk(number, name)
            yield ToolCallChunk(ToolCall(call_id, name, arguments), number)
        usage = reply.get("usage")
        finish = reply.get("finish") or (
            FinishReason.TOOL_CALLS if reply.get("tool_calls") else FinishReason.STOP
        )
        yield FinishChunk(finish, Usage(*usage) if usage else None)


def last_role(request: ModelRequest) -> Role | None:
    return request.messages[-1].role if request.messages else None


def tool_results_in_turn(request: ModelRequest) -> int:
    count = 0
    for message in reversed(request.messages):
        if message.role is Role.USER:
            break
        if message.role is Role.TOOL:
            count += 1
    return count


@dataclass(frozen=True)
class BackendCall:
    """One call ``FakeBackends`` received: the tool it serves (``ToolBackends`` methods
    are per RPC; the fake names them by tool, so tests can say "get_item"), whom it acts
    for, its domain request, the request id a write carries (empty for reads) and its
    deadline in seconds."""

    tool: str
    acting: Acting
    project_id: str
    request: Any
    request_id: str = ""
    timeout_s: float = 0.0


@dataclass
class FakeBackends:
    """An in-memory ``ToolBackends``: every tool's RPC answers with a small value, or with
    what ``answers`` holds for the tool (a value, or an exception to raise), unless
    ``failures`` names the tool; ``block`` makes a tool wait on an event; ``cancelled``
    lists the tools whose call was cancelled while it waited (``cancel_seen`` is set)."""

    calls: list[BackendCall] = field(default_factory=list)
    answers: dict[str, Any] = field(default_factory=dict)
    failures: dict[str, ToolFailure] = field(default_factory=dict)
    block: dict[str, asyncio.Event] = field(default_factory=dict)
    project_reads: int = 0
    skill_reads: int = 0
    skill: SkillDocument | None = None
    entered: dict[str, asyncio.Event] = field(default_factory=dict)
    cancelled: list[str] = field(default_factory=list)
    cancel_seen: asyncio.Event = field(default_factory=asyncio.Event)

    def reached(self, tool: str) -> asyncio.Event:
        """Set once a blocked ``tool`` has been entered."""
        return self.entered.setdefault(tool, asyncio.Event())

    async def _call(
        self,
        tool: str,
        acting: Acting,
        project_id: str,
        request: Any,
        default: Any,
        timeout_s: float,
        request_id: str = "",
    ) -> Any:
        self.calls.append(BackendCall(tool, acting, project_id, request, request_id, timeout_s))
        event = self.block.get(tool)
        if event is not None:
            self.reached(tool).set()
            try:
                await event.wait()
            except asyncio.CancelledError:
                self.cancelled.append(tool)
                self.cancel_seen.set()
                raise
        if tool in self.failures:
            raise self.failures[tool]
        answer = self.answers.get(tool, default)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def list_items(self, acting: Acting, query: ItemQuery, timeout_s: float) -> ItemPage:
        page = ItemPage((_item("epic-1"),), total_size=1)
        return await self._call("list_items", acting, query.project_id, query, page, timeout_s)

    async def get_item(
        self, acting: Acting, project_id: str, item_id: str, timeout_s: float
    ) -> Item:
        return await self._call("get_item", acting, project_id, item_id, _item(item_id), timeout_s)

    async def list_runnable_tickets(
        self, acting: Acting, query: RunnableQuery, timeout_s: float
    ) -> ItemPage:
        page = ItemPage((_item("ticket-1"),), total_size=1)
        return await self._call("list_runnable", acting, query.project_id, query, page, timeout_s)

    async def search_project(
        self, acting: Acting, search: ProjectSearch, timeout_s: float
    ) -> ProjectSearchResult:
        found = ProjectSearchResult((), items_searched=True, skills_searched=True)
        return await self._call(
            "search_project", acting, search.project_id, search, found, timeout_s
        )

    async def list_changesets(
        self, acting: Acting, query: ChangesetQuery, timeout_s: float
    ) -> ChangesetPage:
        page = ChangesetPage(())
        return await self._call("list_changesets", acting, query.project_id, query, page, timeout_s)

    async def propose_changeset(
        self, acting: Acting, proposal: ChangesetProposal, timeout_s: float
    ) -> Changeset:
        proposed = Changeset(
            changeset_id=f"cs-{proposal.request_id}",
            status=ChangesetStatus.PROPOSED,
            title=proposal.title,
            description=proposal.description,
            author_id=acting.human_id,
            recorded_by=acting.actor,
            operations=proposal.operations,
        )
        return await self._call(
            "propose_changeset",
            acting,
            proposal.project_id,
            proposal,
            proposed,
            timeout_s,
            request_id=proposal.request_id,
        )

    async def list_skills(self, acting: Acting, query: SkillQuery, timeout_s: float) -> SkillPage:
        page = SkillPage((_skill("demo-planning"),))
        return await self._call("list_skills", acting, query.project_id, query, page, timeout_s)

    async def read_skill_content(
        self, acting: Acting, project_id: str, name: str, timeout_s: float
    ) -> SkillContent:
        found = SkillContent(_skill(name), f"# {name}")
        return await self._call("read_skill", acting, project_id, name, found, timeout_s)

    async def search_knowledge(
        self, acting: Acting, search: KnowledgeSearch, timeout_s: float
    ) -> KnowledgeHits:
        hits = KnowledgeHits(())
        return await self._call("search_knowledge", acting, "", search, hits, timeout_s)

    async def get_knowledge_entry(
        self, acting: Acting, entry_id: str, timeout_s: float
    ) -> KnowledgeEntry:
        entry = _entry(entry_id, 1, acting)
        return await self._call("get_knowledge", acting, "", entry_id, entry, timeout_s)

    async def create_knowledge_entry(
        self, acting: Acting, entry: NewKnowledgeEntry, timeout_s: float
    ) -> KnowledgeEntry:
        created = _entry(f"k-{entry.request_id}", 1, acting)
        return await self._call(
            "create_knowledge",
            acting,
            entry.project_id,
            entry,
            created,
            timeout_s,
            request_id=entry.request_id,
        )

    async def update_knowledge_entry(
        self, acting: Acting, change: KnowledgeEntryChange, timeout_s: float
    ) -> KnowledgeEntry:
        updated = _entry(change.entry_id, change.version + 1, acting)
        return await self._call(
            "update_knowledge",
            acting,
            "",
            change,
            updated,
            timeout_s,
            request_id=change.request_id,
        )

    async def get_project(self, acting: Acting, project_id: str, timeout_s: float) -> ProjectInfo:
        self.project_reads += 1
        return ProjectInfo(
            project_id=project_id,
            name="Demo",
            description="A demo project",
            organization_id="acme",
            organization_name="Acme",
            planner_skill=self.skill.name if self.skill else "",
            model_credential="demo-credential",
        )

    async def read_skill(
        self, acting: Acting, project_id: str, name: str, timeout_s: float
    ) -> SkillDocument:
        self.skill_reads += 1
        assert self.skill is not None
        return self.skill


def _item(item_id: str) -> Item:
    return Item(item_id, ItemKind.TICKET, f"Item {item_id}", ItemState.OPEN, priority=2)


def _skill(name: str) -> Skill:
    return Skill(name, "", SkillScope.PROJECT, "1.0.0", pinned=False, latest_version="1.0.0")


def _entry(entry_id: str, version: int, acting: Acting) -> KnowledgeEntry:
    return KnowledgeEntry(
        entry_id, KnowledgeKind.NOTE, "t", "", version, acting.human_id, acting.actor
    )
