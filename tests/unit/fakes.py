"""Hand-written in-memory fakes of the core's ports, for unit tests of the turn loop.

They follow the port docstrings (service/core/ports/) closely enough that the turn
runner cannot tell them from the real adapters; the integration and service tiers run
the same scenarios on the real ones.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
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
    ModelFailure,
    ToolFailure,
)
from service.core.model import (
    Usage,
)
from service.core.ports import (
    Acting,
    FinishChunk,
    FinishReason,
    ModelChunk,
    ModelRequest,
    ProjectInfo,
    Role,
    SkillDocument,
    TextChunk,
    ToolCall,
    ToolCallChunk,
    ToolCallStartChunk,
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
