"""The tool backends over gRPC: tracker, skills and knowledge clients acting for a human.

``GrpcToolBackends`` implements the core's ``ToolBackends`` port (``service/core/ports.py``)
on ``grpc.aio`` channels to ``ballet.tracker.v1.TrackerService``,
``ballet.skills.v1.SkillsService`` and ``ballet.knowledge.v1.KnowledgeService``: one
method per RPC, its request and response translated by ``backend_messages``.

Authority (docs/spec/authority.md): every call carries the human's bearer
token (``authorization``), the recorded actor (``x-ballet-actor: planner:<session_id>``) and the
planner's own service credential for that backend (``x-ballet-service-authorization``;
one credential per backend audience), so a backend can honour the actor only
when the caller proves it is the planner, and authorizes the human.

Deadlines (docs/spec/turn-loop.md, Deadlines): every call has the deadline the caller passes in
seconds; it never comes from an inbound RPC, because a turn outlives the RPC that started
it.

Errors (docs/contributing.md): an upstream ``grpc.aio.AioRpcError`` is parsed once, by
``ballet_common.grpc.status.parse``, and translated by one of two tables: ``tool_failure``
for tool calls (the model gets an error result) and ``project_error``/``skill_error`` for the system
prompt's reads (domain ``PlannerError``s the transport maps to status codes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import grpc
from ballet.knowledge.v1 import knowledge_pb2, knowledge_pb2_grpc
from ballet.skills.v1 import skills_pb2, skills_pb2_grpc
from ballet.tracker.v1 import tracker_pb2, tracker_pb2_grpc

from ballet_common.grpc.status import RpcFailure, parse
from service.adapters import backend_messages as messages
from service.core.backend_types import (
    Acting,
    Changeset,
    ChangesetPage,
    ChangesetProposal,
    ChangesetQuery,
    Item,
    ItemPage,
    ItemQuery,
    KnowledgeEntry,
    KnowledgeEntryChange,
    KnowledgeHits,
    KnowledgeSearch,
    NewKnowledgeEntry,
    ProjectInfo,
    ProjectSearch,
    ProjectSearchResult,
    RunnableQuery,
    SkillContent,
    SkillDocument,
    SkillPage,
    SkillQuery,
)
from service.core.errors import NotFound, PlannerError, ToolFailure, Unauthenticated, Unavailable
from service.core.model import JsonObject
from service.core.ports import ToolBackends
from service.core.tools.tracker import full_item

#: Metadata key of the recorded actor, ``planner:<session_id>`` (docs/spec/authority.md).
ACTOR_HEADER = "x-ballet-actor"
#: Metadata key of the planner's own service credential (docs/spec/authority.md).
SERVICE_AUTHORIZATION_HEADER = "x-ballet-service-authorization"
#: Project settings the planner reads (docs/spec/turn-loop.md step 2, 4).
PLANNER_SKILL_SETTING = "planner.skill"
MODEL_CREDENTIAL_SETTING = "planner.model_credential"

# The one table from a backend's status to a tool call's error result (docs/spec/turn-loop.md
# step 5: "any failure ... becomes an error result for the model"). INVALID_ARGUMENT and
# FAILED_PRECONDITION keep the backend's message, since it tells the model what to fix.
_TOOL_REASONS: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.PERMISSION_DENIED: "PERMISSION_DENIED",
    grpc.StatusCode.NOT_FOUND: "NOT_FOUND",
    grpc.StatusCode.INVALID_ARGUMENT: "INVALID_ARGUMENTS",
    grpc.StatusCode.FAILED_PRECONDITION: "INVALID_ARGUMENTS",
    grpc.StatusCode.OUT_OF_RANGE: "INVALID_ARGUMENTS",
    grpc.StatusCode.UNAVAILABLE: "BACKEND_UNAVAILABLE",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
    grpc.StatusCode.ALREADY_EXISTS: "CONFLICT",
}


def tool_failure(error: RpcFailure) -> ToolFailure:
    """Translate a backend's refusal into the ``ToolFailure`` the model sees.

    ``ABORTED`` is ``STALE_VERSION`` (a knowledge update sent an old version; README.md), or
    ``CONFLICT`` when the backend's ``ErrorInfo`` names another race;
    ``UNAUTHENTICATED`` with reason ``TOKEN_EXPIRED`` is ``CREDENTIAL_EXPIRED``, which ends
    the turn ``FAILED`` at the end of the round (docs/spec/authority.md); anything unexpected is
    ``BACKEND_ERROR``.
    """
    code = error.code
    if code == grpc.StatusCode.ABORTED:
        conflict = error.reason not in ("", "STALE_VERSION", "VERSION_MISMATCH", "ABORTED")
        reason = "CONFLICT" if conflict else "STALE_VERSION"
        message = error.message or "the entry changed since it was read; read it again"
        return ToolFailure(reason, message)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        if error.reason == "TOKEN_EXPIRED":
            return ToolFailure("CREDENTIAL_EXPIRED", "the human's credential has expired")
        return ToolFailure("BACKEND_ERROR", "the backend refused the planner's credentials")
    reason = _TOOL_REASONS.get(code, "BACKEND_ERROR")
    if reason == "BACKEND_UNAVAILABLE":
        return ToolFailure(reason, "the backend is unavailable; try again later")
    if reason == "DEADLINE_EXCEEDED":
        return ToolFailure(reason, "the backend did not answer in time")
    if reason == "BACKEND_ERROR":
        return ToolFailure(reason, f"the backend failed ({code.name})")
    return ToolFailure(reason, error.message or reason.lower().replace("_", " "))


def project_error(error: RpcFailure, project_id: str) -> PlannerError:
    # NOT_FOUND and PERMISSION_DENIED look the same, so existence does not leak
    # (docs/spec/authority.md).
    if error.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
        return NotFound(f"project {project_id!r} not found", reason="PROJECT_NOT_FOUND")
    if error.code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated("the tracker refused the token", reason=error.reason or None)
    # Anything else means the project cannot be fetched: docs/spec/turn-loop.md step 2.
    return Unavailable(
        f"the tracker backend failed ({error.code.name})", reason="DEPENDENCY_UNAVAILABLE"
    )


def skill_error(error: RpcFailure, name: str) -> PlannerError:
    if error.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
        return NotFound(f"skill {name!r} not found", reason="SKILL_NOT_FOUND")
    if error.code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated("the skills backend refused the token", reason=error.reason or None)
    return Unavailable(
        f"the skills backend failed ({error.code.name})", reason="DEPENDENCY_UNAVAILABLE"
    )


@contextmanager
def _tool_errors() -> Iterator[None]:
    """Translate a failed RPC of a tool into the ``ToolFailure`` the model sees."""
    try:
        yield
    except grpc.aio.AioRpcError as error:
        raise tool_failure(parse(error)) from None


#: A planner service credential: called for every RPC, so a rotated credential is used
#: without a restart; an empty one sends no header (an mTLS identity proves the planner).
Credential = Callable[[], str]


class GrpcToolBackends:
    """``ToolBackends`` over gRPC (see the module docstring for authority and deadlines).

    ``tracker``, ``skills`` and ``knowledge`` are ``grpc.aio`` channels (made by
    ``ballet_common.grpc.channels.make_channel``; the caller owns and closes them).
    ``tracker_credential``, ``skills_credential`` and ``knowledge_credential`` give the
    planner's service credential for that backend's audience.
    """

    def __init__(
        self,
        *,
        tracker: grpc.aio.Channel,
        skills: grpc.aio.Channel,
        knowledge: grpc.aio.Channel,
        tracker_credential: Credential,
        skills_credential: Credential,
        knowledge_credential: Credential,
    ) -> None:
        # The stubs' overloads pick the async type from the aio channel.
        self._tracker = tracker_pb2_grpc.TrackerServiceStub(tracker)
        self._skills = skills_pb2_grpc.SkillsServiceStub(skills)
        self._knowledge = knowledge_pb2_grpc.KnowledgeServiceStub(knowledge)
        self._tracker_credential = tracker_credential
        self._skills_credential = skills_credential
        self._knowledge_credential = knowledge_credential

    @staticmethod
    def _metadata(acting: Acting, credential: Credential) -> tuple[tuple[str, str], ...]:
        metadata = (
            ("authorization", f"Bearer {acting.token}"),
            (ACTOR_HEADER, acting.actor),
        )
        service_token = credential()
        if not service_token:
            # In production the planner may prove itself by its mTLS identity instead
            # (docs/spec/authority.md); an empty bearer header would only be a malformed one.
            return metadata
        return (*metadata, (SERVICE_AUTHORIZATION_HEADER, f"Bearer {service_token}"))

    def _tracker_meta(self, acting: Acting) -> tuple[tuple[str, str], ...]:
        return self._metadata(acting, self._tracker_credential)

    def _skills_meta(self, acting: Acting) -> tuple[tuple[str, str], ...]:
        return self._metadata(acting, self._skills_credential)

    def _knowledge_meta(self, acting: Acting) -> tuple[tuple[str, str], ...]:
        return self._metadata(acting, self._knowledge_credential)

    # ----------------------------------------------------------------- system prompt

    async def get_project(self, acting: Acting, project_id: str, timeout_s: float) -> ProjectInfo:
        """``TrackerService.GetProject`` as the human, within ``timeout_s`` seconds.

        Returns the project with its ``planner.skill`` and ``planner.model_credential``
        settings (empty when unset) and the human's permissions in it. Raises ``NotFound``
        (``PROJECT_NOT_FOUND``: unknown, or not readable by the human; docs/spec/authority.md),
        ``Unauthenticated`` (the tracker refused the token; its reason, e.g.
        ``TOKEN_EXPIRED``, is kept), ``Unavailable`` (``DEPENDENCY_UNAVAILABLE``: down,
        too slow, or failed; docs/spec/turn-loop.md step 2).
        """
        request = tracker_pb2.GetProjectRequest(project_id=project_id)
        try:
            response = await self._tracker.GetProject(
                request, metadata=self._tracker_meta(acting), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as error:
            raise project_error(parse(error), project_id) from None
        project = response.project
        return ProjectInfo(
            project_id=project.project_id,
            name=project.name,
            description=project.description,
            organization_id=project.organization_id,
            organization_name=project.organization_name,
            planner_skill=project.settings.get(PLANNER_SKILL_SETTING, ""),
            model_credential=project.settings.get(MODEL_CREDENTIAL_SETTING, ""),
            permissions=frozenset(response.permissions),
        )

    async def read_skill(
        self, acting: Acting, project_id: str, name: str, timeout_s: float
    ) -> SkillDocument:
        """``SkillsService.ReadSkill``: SKILL.md of ``name`` in the version the project
        resolves, pins applied (docs/spec/turn-loop.md), within ``timeout_s`` seconds.

        Raises ``NotFound`` (``SKILL_NOT_FOUND``: unknown, or not readable by the human),
        ``Unauthenticated``, ``Unavailable`` (``DEPENDENCY_UNAVAILABLE``).
        """
        request = skills_pb2.ReadSkillRequest(project_id=project_id, name=name)
        try:
            response = await self._skills.ReadSkill(
                request, metadata=self._skills_meta(acting), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as error:
            raise skill_error(parse(error), name) from None
        return SkillDocument(
            name=response.skill.name or name,
            version=response.skill.version,
            content=response.content,
        )

    # ----------------------------------------------------------------- the tools' RPCs
    # Each raises ToolFailure: a backend refusal as tool_failure translates it, or a
    # number the request's field cannot hold (backend_messages). Write RPCs carry the
    # request_id of their domain request: the planner's id of the tool call
    # (docs/spec/authority.md).

    async def list_items(self, acting: Acting, query: ItemQuery, timeout_s: float) -> ItemPage:
        request = messages.list_items_request(query)
        with _tool_errors():
            response = await self._tracker.ListItems(
                request, metadata=self._tracker_meta(acting), timeout=timeout_s
            )
        return messages.item_page(response.items, response.next_page_token, response.total_size)

    async def get_item(
        self, acting: Acting, project_id: str, item_id: str, timeout_s: float
    ) -> Item:
        request = tracker_pb2.GetItemRequest(project_id=project_id, item_id=item_id)
        with _tool_errors():
            response = await self._tracker.GetItem(
                request, metadata=self._tracker_meta(acting), timeout=timeout_s
            )
        return messages.item(response.item)

    async def list_runnable_tickets(
        self, acting: Acting, query: RunnableQuery, timeout_s: float
    ) -> ItemPage:
        request = messages.list_runnable_request(query)
        with _tool_errors():
            response = await self._tracker.ListRunnableTickets(
                request, metadata=self._tracker_meta(acting), timeout=timeout_s
            )
        return messages.item_page(response.items, response.next_page_token, response.total_size)

    async def search_project(
        self, acting: Acting, search: ProjectSearch, timeout_s: float
    ) -> ProjectSearchResult:
        request = messages.search_project_request(search)
        with _tool_errors():
            response = await self._tracker.SearchProject(
                request, metadata=self._tracker_meta(acting), timeout=timeout_s
            )
        return messages.project_search_result(response)

    async def list_changesets(
        self, acting: Acting, query: ChangesetQuery, timeout_s: float
    ) -> ChangesetPage:
        request = messages.list_changesets_request(query)
        with _tool_errors():
            response = await self._tracker.ListChangesets(
                request, metadata=self._tracker_meta(acting), timeout=timeout_s
            )
        return messages.changeset_page(response)

    async def propose_changeset(
        self, acting: Acting, proposal: ChangesetProposal, timeout_s: float
    ) -> Changeset:
        request = messages.propose_changeset_request(proposal)
        with _tool_errors():
            response = await self._tracker.ProposeChangeset(
                request, metadata=self._tracker_meta(acting), timeout=timeout_s
            )
        return messages.changeset(response.changeset)

    async def list_skills(self, acting: Acting, query: SkillQuery, timeout_s: float) -> SkillPage:
        request = messages.list_skills_request(query)
        with _tool_errors():
            response = await self._skills.ListSkills(
                request, metadata=self._skills_meta(acting), timeout=timeout_s
            )
        return messages.skill_page(response)

    async def read_skill_content(
        self, acting: Acting, project_id: str, name: str, timeout_s: float
    ) -> SkillContent:
        request = skills_pb2.ReadSkillRequest(project_id=project_id, name=name)
        with _tool_errors():
            response = await self._skills.ReadSkill(
                request, metadata=self._skills_meta(acting), timeout=timeout_s
            )
        return messages.skill_content(response)

    async def search_knowledge(
        self, acting: Acting, search: KnowledgeSearch, timeout_s: float
    ) -> KnowledgeHits:
        request = messages.search_knowledge_request(search)
        with _tool_errors():
            response = await self._knowledge.SearchKnowledge(
                request, metadata=self._knowledge_meta(acting), timeout=timeout_s
            )
        return messages.knowledge_hits(response)

    async def get_knowledge_entry(
        self, acting: Acting, entry_id: str, timeout_s: float
    ) -> KnowledgeEntry:
        request = knowledge_pb2.GetKnowledgeEntryRequest(entry_id=entry_id)
        with _tool_errors():
            response = await self._knowledge.GetKnowledgeEntry(
                request, metadata=self._knowledge_meta(acting), timeout=timeout_s
            )
        return messages.knowledge_entry(response.entry)

    async def create_knowledge_entry(
        self, acting: Acting, entry: NewKnowledgeEntry, timeout_s: float
    ) -> KnowledgeEntry:
        request = messages.create_knowledge_request(entry)
        with _tool_errors():
            response = await self._knowledge.CreateKnowledgeEntry(
                request, metadata=self._knowledge_meta(acting), timeout=timeout_s
            )
        return messages.knowledge_entry(response.entry)

    async def update_knowledge_entry(
        self, acting: Acting, change: KnowledgeEntryChange, timeout_s: float
    ) -> KnowledgeEntry:
        request = messages.update_knowledge_request(change)
        with _tool_errors():
            response = await self._knowledge.UpdateKnowledgeEntry(
                request, metadata=self._knowledge_meta(acting), timeout=timeout_s
            )
        return messages.knowledge_entry(response.entry)


if TYPE_CHECKING:
    # mypy checks here that the class implements the port, method by method.
    _PORT: type[ToolBackends] = GrpcToolBackends


def _full_item(message: tracker_pb2.Item) -> JsonObject:
    """A tracker ``Item`` message as the ``get_item`` tool shows it (``{"item": ...}``'s
    value). Tools outside the service that must produce the planner's exact tool result
    from a tracker answer (the peer benchmark) use it; the service itself goes through
    ``service.core.tools``."""
    return full_item(messages.item(message))
