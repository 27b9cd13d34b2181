"""The tool backends over gRPC: tracker, skills and knowledge clients acting for a human.

``GrpcToolBackends`` implements the core's ``ToolBackends`` port (``service/core/ports.py``)
on ``grpc.aio`` channels to ``ballet.tracker.v1.TrackerService``,
``ballet.skills.v1.SkillsService`` and ``ballet.knowledge.v1.KnowledgeService``.

Authority (seed: Authority; SPEC section 4): every call carries the human's bearer token
(``authorization``), the recorded actor (``x-ballet-actor: planner:<session_id>``) and the
planner's own service credential (``x-ballet-service-authorization``), so a backend can
honour the actor only when the caller proves it is the planner, and authorizes the human.

Deadlines (SPEC section 5, Deadlines): every call has the deadline the caller passes in
seconds; it never comes from an inbound RPC, because a turn outlives the RPC that started
it.

Errors (STYLE rules 5 and 6): an upstream ``grpc.aio.AioRpcError`` is parsed once, in
``upstream_error``, and translated by one of two tables: ``tool_failure`` for tool calls
(the model gets an error result) and ``project_error``/``skill_error`` for the system
prompt's reads (domain ``PlannerError``s the transport maps to status codes).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import grpc
from ballet.knowledge.v1 import knowledge_pb2, knowledge_pb2_grpc
from ballet.skills.v1 import skills_pb2, skills_pb2_grpc
from ballet.tracker.v1 import tracker_pb2, tracker_pb2_grpc
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped, unused-ignore]

from service.core.errors import (
    NotFound,
    PlannerError,
    ToolFailure,
    Unauthenticated,
    Unavailable,
)
from service.core.model import JsonObject
from service.core.ports import Acting, BackendCall, BackendResult, ProjectInfo, SkillDocument

#: Metadata key of the recorded actor, ``planner:<session_id>`` (SPEC section 4).
ACTOR_HEADER = "x-ballet-actor"
#: Metadata key of the planner's own service credential (SPEC section 4).
SERVICE_AUTHORIZATION_HEADER = "x-ballet-service-authorization"
#: Project settings the planner reads (seed: Instructions; SPEC section 5 step 2, 4).
PLANNER_SKILL_SETTING = "planner.skill"
MODEL_CREDENTIAL_SETTING = "planner.model_credential"

_STATUS_DETAILS_KEY = "grpc-status-details-bin"
#: The backend each tool calls, whose own credential goes with the call (issue 14).
_TOOL_BACKENDS = {
    "list_items": "tracker",
    "get_item": "tracker",
    "list_runnable": "tracker",
    "search_project": "tracker",
    "list_changesets": "tracker",
    "propose_changeset": "tracker",
    "list_skills": "skills",
    "read_skill": "skills",
    "search_knowledge": "knowledge",
    "get_knowledge": "knowledge",
    "create_knowledge": "knowledge",
    "update_knowledge": "knowledge",
}


@dataclass(frozen=True)
class UpstreamError:
    """A failed backend RPC: its status code, message and ``ErrorInfo`` reason (AIP-193;
    empty when the backend sent none)."""

    code: grpc.StatusCode
    message: str
    reason: str = ""


def upstream_error(error: grpc.aio.AioRpcError) -> UpstreamError:
    """Parse a failed RPC once: code, details and the first ``ErrorInfo`` reason found in
    the ``google.rpc.Status`` of the trailing metadata (``grpc-status-details-bin``)."""
    reason = ""
    for key, value in error.trailing_metadata() or ():
        if key != _STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except Exception:  # a malformed detail must not hide the status code itself
            break
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                reason = info.reason
                break
        break
    return UpstreamError(code=error.code(), message=error.details() or "", reason=reason)


# The one table from a backend's status to a tool call's error result (SPEC section 5
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


def tool_failure(error: UpstreamError) -> ToolFailure:
    """Translate a backend's refusal into the ``ToolFailure`` the model sees.

    ``ABORTED`` is ``STALE_VERSION`` (a knowledge update sent an old version; SPEC section
    9), or ``CONFLICT`` when the backend's ``ErrorInfo`` names another race;
    ``UNAUTHENTICATED`` with reason ``TOKEN_EXPIRED`` is ``CREDENTIAL_EXPIRED``, which ends
    the turn ``FAILED`` at the end of the round (SPEC section 4); anything unexpected is
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


def project_error(error: UpstreamError, project_id: str) -> PlannerError:
    # NOT_FOUND and PERMISSION_DENIED look the same, so existence does not leak (SPEC 4).
    if error.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
        return NotFound(f"project {project_id!r} not found", reason="PROJECT_NOT_FOUND")
    if error.code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated("the tracker refused the token", reason=error.reason or None)
    # Anything else means the project cannot be fetched: SPEC section 5 step 2.
    return Unavailable(
        f"the tracker backend failed ({error.code.name})", reason="DEPENDENCY_UNAVAILABLE"
    )


def skill_error(error: UpstreamError, name: str) -> PlannerError:
    if error.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
        return NotFound(f"skill {name!r} not found", reason="SKILL_NOT_FOUND")
    if error.code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated("the skills backend refused the token", reason=error.reason or None)
    return Unavailable(
        f"the skills backend failed ({error.code.name})", reason="DEPENDENCY_UNAVAILABLE"
    )


class GrpcToolBackends:
    """``ToolBackends`` over gRPC (see the module docstring for authority and deadlines).

    ``tracker``, ``skills`` and ``knowledge`` are ``grpc.aio`` channels (made by
    ``service.adapters.channels.make_channel``; the caller owns and closes them).
    ``tracker_token``, ``skills_token`` and ``knowledge_token`` return the planner's
    current service credential for that backend's audience alone (a backend cannot
    replay what it receives to another); each is called for every RPC, so a rotated
    credential is picked up without a restart, and an empty one sends no
    ``x-ballet-service-authorization`` (the mTLS identity proves the planner).
    """

    def __init__(
        self,
        *,
        tracker: grpc.aio.Channel,
        skills: grpc.aio.Channel,
        knowledge: grpc.aio.Channel,
        tracker_token: Callable[[], str],
        skills_token: Callable[[], str],
        knowledge_token: Callable[[], str],
    ) -> None:
        # The stubs' overloads pick the async type from an aio channel; grpc has no type
        # information here, so say which one it is.
        self._tracker = cast(
            "tracker_pb2_grpc.TrackerServiceAsyncStub", tracker_pb2_grpc.TrackerServiceStub(tracker)
        )
        self._skills = cast(
            "skills_pb2_grpc.SkillsServiceAsyncStub", skills_pb2_grpc.SkillsServiceStub(skills)
        )
        self._knowledge = cast(
            "knowledge_pb2_grpc.KnowledgeServiceAsyncStub",
            knowledge_pb2_grpc.KnowledgeServiceStub(knowledge),
        )
        self._service_tokens = {
            "tracker": tracker_token,
            "skills": skills_token,
            "knowledge": knowledge_token,
        }
        self._handlers: dict[str, _Handler] = {
            "list_items": self._list_items,
            "get_item": self._get_item,
            "list_runnable": self._list_runnable,
            "search_project": self._search_project,
            "list_changesets": self._list_changesets,
            "propose_changeset": self._propose_changeset,
            "list_skills": self._list_skills,
            "read_skill": self._read_skill_tool,
            "search_knowledge": self._search_knowledge,
            "get_knowledge": self._get_knowledge,
            "create_knowledge": self._create_knowledge,
            "update_knowledge": self._update_knowledge,
        }

    def _metadata(self, acting: Acting, backend: str) -> tuple[tuple[str, str], ...]:
        metadata = (
            ("authorization", f"Bearer {acting.token}"),
            (ACTOR_HEADER, acting.actor),
        )
        service_token = self._service_tokens[backend]()
        if not service_token:
            # In production the planner may prove itself by its mTLS identity instead
            # (SPEC section 4); an empty bearer header would only be a malformed one.
            return metadata
        return (*metadata, (SERVICE_AUTHORIZATION_HEADER, f"Bearer {service_token}"))

    async def get_project(self, acting: Acting, project_id: str, timeout_s: float) -> ProjectInfo:
        """``TrackerService.GetProject`` as the human, within ``timeout_s`` seconds.

        Returns the project with its ``planner.skill`` and ``planner.model_credential``
        settings (empty when unset) and the human's permissions in it. Raises ``NotFound``
        (``PROJECT_NOT_FOUND``: unknown, or not readable by the human; SPEC section 4),
        ``Unauthenticated`` (the tracker refused the token; its reason, e.g.
        ``TOKEN_EXPIRED``, is kept), ``Unavailable`` (``DEPENDENCY_UNAVAILABLE``: down,
        too slow, or failed; SPEC section 5 step 2).
        """
        request = tracker_pb2.GetProjectRequest(project_id=project_id)
        try:
            response = await self._tracker.GetProject(
                request, metadata=self._metadata(acting, "tracker"), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as error:
            raise project_error(upstream_error(error), project_id) from None
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
        resolves, pins applied (seed: Instructions), within ``timeout_s`` seconds.

        Raises ``NotFound`` (``SKILL_NOT_FOUND``: unknown, or not readable by the human),
        ``Unauthenticated``, ``Unavailable`` (``DEPENDENCY_UNAVAILABLE``).
        """
        request = skills_pb2.ReadSkillRequest(project_id=project_id, name=name)
        try:
            response = await self._skills.ReadSkill(
                request, metadata=self._metadata(acting, "skills"), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as error:
            raise skill_error(upstream_error(error), name) from None
        return SkillDocument(
            name=response.skill.name or name,
            version=response.skill.version,
            content=response.content,
        )

    # ----------------------------------------------------------------------- tools

    async def invoke(self, call: BackendCall) -> BackendResult:
        """Run one tool against its backend, as ``call.acting`` within ``call.timeout_s``.

        ``call.arguments`` were validated against the tool's schema by the runner
        (``service/core/tools.py``, which documents each output shape). Write RPCs carry
        ``call.request_id`` (the tool call's id), so a retry never writes twice (SPEC
        section 4). Raises ``ToolFailure``: ``UNKNOWN_TOOL``, or a backend refusal as
        ``tool_failure`` translates it.
        """
        handler = self._handlers.get(call.tool)
        if handler is None:
            raise ToolFailure("UNKNOWN_TOOL", f"there is no tool named {call.tool!r}")
        options = _CallOptions(
            metadata=self._metadata(call.acting, _TOOL_BACKENDS[call.tool]),
            timeout=call.timeout_s,
        )
        try:
            return await handler(call, options)
        except grpc.aio.AioRpcError as error:
            raise tool_failure(upstream_error(error)) from None

    async def _list_items(self, call: BackendCall, options: _CallOptions) -> BackendResult:
        args = call.arguments
        request = tracker_pb2.ListItemsRequest(
            project_id=call.project_id,
            kind=_ITEM_KINDS.get(args.get("kind", ""), tracker_pb2.ITEM_KIND_UNSPECIFIED),
            state=_ITEM_STATES.get(args.get("state", ""), tracker_pb2.ITEM_STATE_UNSPECIFIED),
            epic_id=args.get("epic_id", ""),
            milestone_id=args.get("milestone_id", ""),
            page_size=args.get("page_size", DEFAULT_ITEMS_PAGE),
            page_token=args.get("page_token", ""),
        )
        response = await self._tracker.ListItems(request, **options.kwargs())
        return _item_page(response.items, response.next_page_token, response.total_size)

    async def _get_item(self, call: BackendCall, options: _CallOptions) -> BackendResult:
        request = tracker_pb2.GetItemRequest(
            project_id=call.project_id, item_id=call.arguments["item_id"]
        )
        response = await self._tracker.GetItem(request, **options.kwargs())
        return BackendResult(output={"item": _full_item(response.item)})

    async def _list_runnable(self, call: BackendCall, options: _CallOptions) -> BackendResult:
        args = call.arguments
        request = tracker_pb2.ListRunnableTicketsRequest(
            project_id=call.project_id,
            page_size=args.get("page_size", DEFAULT_ITEMS_PAGE),
            page_token=args.get("page_token", ""),
        )
        response = await self._tracker.ListRunnableTickets(request, **options.kwargs())
        return _item_page(response.items, response.next_page_token, response.total_size)

    async def _search_project(self, call: BackendCall, options: _CallOptions) -> BackendResult:
        args = call.arguments
        request = tracker_pb2.SearchProjectRequest(
            project_id=call.project_id,
            query=args["query"],
            page_size=args.get("limit", DEFAULT_SEARCH_LIMIT),
        )
        response = await self._tracker.SearchProject(request, **options.kwargs())
        if not (response.items_searched or response.skills_searched):
            # SPEC section 4: with neither tracker.read nor skill.read it is a refusal.
            raise ToolFailure(
                "PERMISSION_DENIED", "the human may read neither the tracker nor the skills"
            )
        results: list[JsonObject] = []
        for hit in response.results:
            which = hit.WhichOneof("hit")
            entry: JsonObject
            if which == "item":
                entry = {"item": _compact_item(hit.item)}
            elif which == "skill":
                entry = {
                    "skill": {
                        "name": hit.skill.name,
                        "description": hit.skill.description,
                        "version": hit.skill.version,
                    }
                }
            else:
                continue
            entry["score"] = round(hit.score, 4)
            entry["snippet"] = hit.snippet
            results.append(entry)
        output: JsonObject = {
            "results": results,
            "items_searched": response.items_searched,
            "skills_searched": response.skills_searched,
        }
        return BackendResult(output=output)

    async def _list_changesets(self, call: BackendCall, options: _CallOptions) -> BackendResult:
        args = call.arguments
        request = tracker_pb2.ListChangesetsRequest(
            project_id=call.project_id,
            status=_CHANGESET_STATUSES.get(
                args.get("status", ""), tracker_pb2.CHANGESET_STATUS_UNSPECIFIED
            ),
            page_size=args.get("page_size", DEFAULT_CHANGESETS_PAGE),
            page_token=args.get("page_token", ""),
        )
        response = await self._tracker.ListChangesets(request, **options.kwargs())
        output: JsonObject = {"changesets": [_changeset(c) for c in response.changesets]}
        if response.next_page_token:
            output["next_page_token"] = response.next_page_token
        return BackendResult(output=output)

    async def _propose_changeset(self, call: BackendCall, options: _CallOptions) -> BackendResult:
        args = call.arguments
        request = tracker_pb2.ProposeChangesetRequest(
            request_id=call.request_id,
            project_id=call.project_id,
            title=args["title"],
            description=args.get("description", ""),
            operations=[_operation(operation) for operation in args["operations"]],
        )
        response = await self._tracker.ProposeChangeset(request, **options.kwargs())
        changeset = response.changeset
        return BackendResult(
            output={"changeset": _changeset(changeset)}, changeset_id=changeset.changeset_id
        )

    async def _list_skills(self, call: BackendCall, options: _CallOptions) -> BackendResult:
        # The tool takes no page token (seed: "the project's effective skills"), so read
        # every page, up to a bound that keeps one call's cost known.
        skills: list[JsonObject] = []
        token = ""
        for _ in range(_MAX_SKILL_PAGES):
            request = skills_pb2.ListSkillsRequest(
                project_id=call.project_id, page_size=_SKILLS_PAGE, page_token=token
            )
            response = await self._skills.ListSkills(request, **options.kwargs())
            skills.extend(_skill(skill) for skill in response.skills)
            token = response.next_page_token
            if not token:
                break
        return BackendResult(output={"skills": skills})

    async def _read_skill_tool(self, call: BackendCall, options: _CallOptions) -> BackendResult:
        request = skills_pb2.ReadSkillRequest(
            project_id=call.project_id, name=call.arguments["name"]
        )
        response = await self._skills.ReadSkill(request, **options.kwargs())
        skill = _skill(response.skill)
        del skill["latest_version"]
        if not skill["description"]:
            del skill["description"]
        return BackendResult(output={"skill": skill, "content": response.content})

    async def _search_knowledge(self, call: BackendCall, options: _CallOptions) -> BackendResult:
        args = call.arguments
        request = knowledge_pb2.SearchKnowledgeRequest(
            query=args["query"],
            kind=_KNOWLEDGE_KINDS.get(
                args.get("kind", ""), knowledge_pb2.KNOWLEDGE_KIND_UNSPECIFIED
            ),
            page_size=args.get("limit", DEFAULT_SEARCH_LIMIT),
        )
        response = await self._knowledge.SearchKnowledge(request, **options.kwargs())
        hits: list[JsonObject] = []
        for hit in response.hits:
            entry = _entry_head(hit.entry)
            _set_time(entry, "update_time", hit.entry, "update_time")
            entry["score"] = round(hit.score, 4)
            entry["snippet"] = hit.snippet
            hits.append(entry)
        output: JsonObject = {"hits": hits}
        if response.next_page_token:
            output["next_page_token"] = response.next_page_token
        return BackendResult(output=output)

    async def _get_knowledge(self, call: BackendCall, options: _CallOptions) -> BackendResult:
        request = knowledge_pb2.GetKnowledgeEntryRequest(entry_id=call.arguments["entry_id"])
        response = await self._knowledge.GetKnowledgeEntry(request, **options.kwargs())
        return BackendResult(output={"entry": _full_entry(response.entry)})

    async def _create_knowledge(self, call: BackendCall, options: _CallOptions) -> BackendResult:
        args = call.arguments
        request = knowledge_pb2.CreateKnowledgeEntryRequest(
            request_id=call.request_id,
            kind=_KNOWLEDGE_KINDS[args["kind"]],
            title=args["title"],
            body=args["body"],
            status=args.get("status", ""),
            project_id=call.project_id,
            item_ids=args.get("item_ids", []),
        )
        response = await self._knowledge.CreateKnowledgeEntry(request, **options.kwargs())
        return _written(response.entry)

    async def _update_knowledge(self, call: BackendCall, options: _CallOptions) -> BackendResult:
        args = call.arguments
        request = knowledge_pb2.UpdateKnowledgeEntryRequest(
            request_id=call.request_id,
            entry_id=args["entry_id"],
            version=args["version"],
            title=args.get("title"),
            body=args.get("body"),
            status=args.get("status"),
            item_ids=args.get("item_ids", []),
            # An explicit list, even an empty one, replaces the links (the contract's rule).
            replace_item_ids="item_ids" in args,
        )
        response = await self._knowledge.UpdateKnowledgeEntry(request, **options.kwargs())
        return _written(response.entry)


# --------------------------------------------------------------------------- helpers

#: Default page sizes when the model gives none: small enough that a page of compact
#: results stays under the 16 KiB cut (SPEC section 5 step 5), so page tokens stay usable.
DEFAULT_ITEMS_PAGE = 50
DEFAULT_CHANGESETS_PAGE = 10
DEFAULT_SEARCH_LIMIT = 10
#: A created item's priority when the model gives none (the middle of 0 to 4).
DEFAULT_PRIORITY = 2
_SKILLS_PAGE = 200
_MAX_SKILL_PAGES = 5


@dataclass(frozen=True)
class _CallOptions:
    """What every RPC of one tool call carries: the acting metadata and the deadline (s)."""

    metadata: tuple[tuple[str, str], ...]
    timeout: float

    def kwargs(self) -> dict[str, Any]:
        return {"metadata": self.metadata, "timeout": self.timeout}


_Handler = Callable[[BackendCall, _CallOptions], Awaitable[BackendResult]]

_ITEM_KINDS = {
    "milestone": tracker_pb2.ITEM_KIND_MILESTONE,
    "epic": tracker_pb2.ITEM_KIND_EPIC,
    "ticket": tracker_pb2.ITEM_KIND_TICKET,
}
_ITEM_STATES = {
    "open": tracker_pb2.ITEM_STATE_OPEN,
    "in_progress": tracker_pb2.ITEM_STATE_IN_PROGRESS,
    "blocked": tracker_pb2.ITEM_STATE_BLOCKED,
    "closed": tracker_pb2.ITEM_STATE_CLOSED,
}
_CHANGESET_STATUSES = {
    "proposed": tracker_pb2.CHANGESET_STATUS_PROPOSED,
    "applied": tracker_pb2.CHANGESET_STATUS_APPLIED,
    "rejected": tracker_pb2.CHANGESET_STATUS_REJECTED,
}
_KNOWLEDGE_KINDS = {
    "document": knowledge_pb2.KNOWLEDGE_KIND_DOCUMENT,
    "decision": knowledge_pb2.KNOWLEDGE_KIND_DECISION,
    "note": knowledge_pb2.KNOWLEDGE_KIND_NOTE,
    "debt": knowledge_pb2.KNOWLEDGE_KIND_DEBT,
}
_SKILL_SCOPES = {
    skills_pb2.SKILL_SCOPE_ORGANIZATION: "organization",
    skills_pb2.SKILL_SCOPE_PROJECT: "project",
}
_ITEM_KIND_NAMES = {value: name for name, value in _ITEM_KINDS.items()}
_ITEM_STATE_NAMES = {value: name for name, value in _ITEM_STATES.items()}
_CHANGESET_STATUS_NAMES = {value: name for name, value in _CHANGESET_STATUSES.items()}
_KNOWLEDGE_KIND_NAMES = {value: name for name, value in _KNOWLEDGE_KINDS.items()}


def _set_time(output: JsonObject, key: str, message: Any, field: str) -> None:
    if message.HasField(field):
        output[key] = getattr(message, field).ToJsonString()


def _compact_item(item: tracker_pb2.Item) -> JsonObject:
    output: JsonObject = {
        "item_id": item.item_id,
        "kind": _ITEM_KIND_NAMES.get(item.kind, "unspecified"),
        "title": item.title,
        "state": _ITEM_STATE_NAMES.get(item.state, "unspecified"),
        "priority": item.priority,
    }
    if item.ticket_type:
        output["ticket_type"] = item.ticket_type
    if item.epic_id:
        output["epic_id"] = item.epic_id
    if item.milestone_id:
        output["milestone_id"] = item.milestone_id
    if item.labels:
        output["labels"] = list(item.labels)
    return output


def _full_item(item: tracker_pb2.Item) -> JsonObject:
    output = _compact_item(item)
    output["description"] = item.description
    output["acceptance_criteria"] = item.acceptance_criteria
    output["blocked_by_ids"] = list(item.blocked_by_ids)
    output["blocks_ids"] = list(item.blocks_ids)
    if item.HasField("policy"):
        output["policy"] = {"mode": item.policy.mode, "settings": dict(item.policy.settings)}
    _set_time(output, "create_time", item, "create_time")
    _set_time(output, "update_time", item, "update_time")
    return output


def _item_page(items: Any, next_page_token: str, total_size: int) -> BackendResult:
    output: JsonObject = {"items": [_compact_item(item) for item in items]}
    # Proto3 cannot tell "0" from "unknown"; 0 next to items means the backend did not say.
    if total_size or not output["items"]:
        output["total_size"] = total_size
    if next_page_token:
        output["next_page_token"] = next_page_token
    return BackendResult(output=output)


def _operation(operation: JsonObject) -> tracker_pb2.ChangesetOperation:
    """One operation of ``propose_changeset`` (tools.py schema) as the contract's message.

    Fields are copied by name, one by one: nothing the schema does not name (an execution
    policy above all; SPEC section 4) can reach the tracker.
    """
    if "create_item" in operation:
        create = operation["create_item"]
        return tracker_pb2.ChangesetOperation(
            create_item=tracker_pb2.CreateItemOperation(
                ref=create.get("ref", ""),
                kind=_ITEM_KINDS[create["kind"]],
                title=create["title"],
                description=create.get("description", ""),
                acceptance_criteria=create.get("acceptance_criteria", ""),
                priority=create.get("priority", DEFAULT_PRIORITY),
                ticket_type=create.get("ticket_type", ""),
                epic_id=create.get("epic_id", ""),
                milestone_id=create.get("milestone_id", ""),
            )
        )
    if "update_item" in operation:
        update = operation["update_item"]
        state = update.get("state")
        return tracker_pb2.ChangesetOperation(
            update_item=tracker_pb2.UpdateItemOperation(
                item_id=update["item_id"],
                title=update.get("title"),
                description=update.get("description"),
                acceptance_criteria=update.get("acceptance_criteria"),
                state=_ITEM_STATES[state] if state is not None else None,
                priority=update.get("priority"),
                epic_id=update.get("epic_id"),
                milestone_id=update.get("milestone_id"),
            )
        )
    remove = "remove_dependency" in operation
    dependency = operation["remove_dependency" if remove else "add_dependency"]
    return tracker_pb2.ChangesetOperation(
        dependency=tracker_pb2.DependencyOperation(
            item_id=dependency["item_id"],
            blocked_by_id=dependency["blocked_by_id"],
            remove=remove,
        )
    )


def _operation_json(operation: tracker_pb2.ChangesetOperation) -> JsonObject:
    # The same shapes propose_changeset takes; a policy a human set is left out.
    which = operation.WhichOneof("operation")
    if which == "create_item":
        create = operation.create_item
        fields: JsonObject = {
            "kind": _ITEM_KIND_NAMES.get(create.kind, "unspecified"),
            "title": create.title,
            "priority": create.priority,
        }
        for name in (
            "ref",
            "description",
            "acceptance_criteria",
            "ticket_type",
            "epic_id",
            "milestone_id",
        ):
            value = getattr(create, name)
            if value:
                fields[name] = value
        return {"create_item": fields}
    if which == "update_item":
        update: Any = operation.update_item  # HasField by a computed name
        fields = {"item_id": update.item_id}
        for name in (
            "title",
            "description",
            "acceptance_criteria",
            "priority",
            "epic_id",
            "milestone_id",
        ):
            if update.HasField(name):
                fields[name] = getattr(update, name)
        if update.HasField("state"):
            fields["state"] = _ITEM_STATE_NAMES.get(update.state, "unspecified")
        return {"update_item": fields}
    if which == "dependency":
        dependency = operation.dependency
        key = "remove_dependency" if dependency.remove else "add_dependency"
        return {key: {"item_id": dependency.item_id, "blocked_by_id": dependency.blocked_by_id}}
    return {}


def _changeset(changeset: tracker_pb2.Changeset) -> JsonObject:
    output: JsonObject = {
        "changeset_id": changeset.changeset_id,
        "status": _CHANGESET_STATUS_NAMES.get(changeset.status, "unspecified"),
        "title": changeset.title,
    }
    if changeset.description:
        output["description"] = changeset.description
    output["author_id"] = changeset.author_id
    output["recorded_by"] = changeset.recorded_by
    _set_time(output, "create_time", changeset, "create_time")
    output["operations"] = [shape for shape in map(_operation_json, changeset.operations) if shape]
    return output


def _skill(skill: skills_pb2.Skill) -> JsonObject:
    return {
        "name": skill.name,
        "description": skill.description,
        "scope": _SKILL_SCOPES.get(skill.scope, "unspecified"),
        "version": skill.version,
        "pinned": skill.pinned,
        "latest_version": skill.latest_version,
    }


def _entry_head(entry: knowledge_pb2.KnowledgeEntry) -> JsonObject:
    return {
        "entry_id": entry.entry_id,
        "kind": _KNOWLEDGE_KIND_NAMES.get(entry.kind, "unspecified"),
        "title": entry.title,
        "status": entry.status,
        "version": entry.version,
        "author_id": entry.author_id,
        "recorded_by": entry.recorded_by,
        "project_ids": list(entry.project_ids),
        "item_ids": list(entry.item_ids),
    }


def _full_entry(entry: knowledge_pb2.KnowledgeEntry) -> JsonObject:
    output = _entry_head(entry)
    output["body"] = entry.body
    output["supersedes_ids"] = list(entry.supersedes_ids)
    output["superseded_by_ids"] = list(entry.superseded_by_ids)
    _set_time(output, "create_time", entry, "create_time")
    _set_time(output, "update_time", entry, "update_time")
    return output


def _written(entry: knowledge_pb2.KnowledgeEntry) -> BackendResult:
    return BackendResult(
        output={"entry": _entry_head(entry)},
        knowledge_entry_id=entry.entry_id,
        knowledge_version=entry.version,
    )
