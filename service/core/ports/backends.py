"""Backends port: the tracker, skills and knowledge backends the tools and the system
prompt call, acting for a human."""

from __future__ import annotations

from typing import Protocol

from service.core import backend_types as backend

#: Defined with the backends' other types; named here too, where the ports' users look.
Acting = backend.Acting
ProjectInfo = backend.ProjectInfo
SkillDocument = backend.SkillDocument


class ToolBackends(Protocol):
    """The tracker, skills and knowledge backends, acting for a human: one method per RPC
    the tools and the system prompt use, in the types of ``service/core/backend_types.py``.
    Every call acts as ``acting`` (docs/spec/authority.md) within ``timeout_s``
    seconds (docs/spec/turn-loop.md, deadlines).

    ``get_project`` (the project, its ``planner.*`` settings and the human's permissions)
    and ``read_skill`` (SKILL.md in the version the project resolves)
    serve the system prompt and raise ``PlannerError``s: ``NotFound``
    (``PROJECT_NOT_FOUND``/``SKILL_NOT_FOUND``: unknown or not readable, so existence does
    not leak), ``Unauthenticated`` (its reason, e.g. ``TOKEN_EXPIRED``, kept) and
    ``Unavailable`` (``DEPENDENCY_UNAVAILABLE``; docs/spec/turn-loop.md).

    The tools' methods raise ``ToolFailure`` with the reason the model sees:
    ``PERMISSION_DENIED``, ``NOT_FOUND``, ``INVALID_ARGUMENTS`` (the backend's explanation,
    or a number its field cannot hold, named), ``STALE_VERSION``, ``CONFLICT``,
    ``BACKEND_UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``CREDENTIAL_EXPIRED``,
    ``BACKEND_ERROR``. ``read_skill_content`` is ``ReadSkill`` for the ``read_skill`` tool.
    """

    async def get_project(
        self, acting: Acting, project_id: str, timeout_s: float
    ) -> ProjectInfo: ...
    async def read_skill(
        self, acting: Acting, project_id: str, name: str, timeout_s: float
    ) -> SkillDocument: ...
    async def list_items(
        self, acting: Acting, query: backend.ItemQuery, timeout_s: float
    ) -> backend.ItemPage: ...
    async def get_item(
        self, acting: Acting, project_id: str, item_id: str, timeout_s: float
    ) -> backend.Item: ...
    async def list_runnable_tickets(
        self, acting: Acting, query: backend.RunnableQuery, timeout_s: float
    ) -> backend.ItemPage: ...
    async def search_project(
        self, acting: Acting, search: backend.ProjectSearch, timeout_s: float
    ) -> backend.ProjectSearchResult: ...
    async def list_changesets(
        self, acting: Acting, query: backend.ChangesetQuery, timeout_s: float
    ) -> backend.ChangesetPage: ...
    async def propose_changeset(
        self, acting: Acting, proposal: backend.ChangesetProposal, timeout_s: float
    ) -> backend.Changeset: ...
    async def list_skills(
        self, acting: Acting, query: backend.SkillQuery, timeout_s: float
    ) -> backend.SkillPage: ...
    async def read_skill_content(
        self, acting: Acting, project_id: str, name: str, timeout_s: float
    ) -> backend.SkillContent: ...
    async def search_knowledge(
        self, acting: Acting, search: backend.KnowledgeSearch, timeout_s: float
    ) -> backend.KnowledgeHits: ...
    async def get_knowledge_entry(
        self, acting: Acting, entry_id: str, timeout_s: float
    ) -> backend.KnowledgeEntry: ...
    async def create_knowledge_entry(
        self, acting: Acting, entry: backend.NewKnowledgeEntry, timeout_s: float
    ) -> backend.KnowledgeEntry: ...
    async def update_knowledge_entry(
        self, acting: Acting, change: backend.KnowledgeEntryChange, timeout_s: float
    ) -> backend.KnowledgeEntry: ...
