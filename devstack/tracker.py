"""The devstack's ``ballet.tracker.v1.TrackerService``: projects, items, search, changesets.

Permissions follow what the tools need: reads need ``tracker.read``, proposing needs
``tracker.write``, and project search returns items with ``tracker.read`` and skills with
``skill.read`` (docs/spec/authority.md). Changesets stay ``PROPOSED``: no RPC applies them.
"""

from __future__ import annotations

from typing import Any

import grpc
from ballet.tracker.v1 import tracker_pb2, tracker_pb2_grpc
from google.protobuf import json_format, timestamp_pb2
from sqlalchemy.ext.asyncio import AsyncSession

from devstack.auth import SKILL_READ, TRACKER_READ, TRACKER_WRITE, Caller
from devstack.errors import InvalidArgument, NotFound, PermissionDenied
from devstack.pages import PageTokens, page_size
from devstack.rpc import Backend
from devstack.store import Store
from devstack.store import tracker as items_store
from devstack.store.access import project_access, require
from devstack.store.idempotency import check_request_id, digest, remember, replay_ref
from devstack.store.records import (
    Access,
    ChangesetRecord,
    ItemPage,
    ItemRecord,
    ProjectRecord,
    SkillView,
)
from devstack.store.skills import effective_skills

SERVICE = "ballet.tracker.v1.TrackerService"
DOMAIN = "tracker.ballet"

KIND_NAMES = {
    tracker_pb2.ITEM_KIND_MILESTONE: "milestone",
    tracker_pb2.ITEM_KIND_EPIC: "epic",
    tracker_pb2.ITEM_KIND_TICKET: "ticket",
}
STATE_NAMES = {
    tracker_pb2.ITEM_STATE_OPEN: "open",
    tracker_pb2.ITEM_STATE_IN_PROGRESS: "in_progress",
    tracker_pb2.ITEM_STATE_BLOCKED: "blocked",
    tracker_pb2.ITEM_STATE_CLOSED: "closed",
}
STATUS_NAMES = {
    tracker_pb2.CHANGESET_STATUS_PROPOSED: "proposed",
    tracker_pb2.CHANGESET_STATUS_APPLIED: "applied",
    tracker_pb2.CHANGESET_STATUS_REJECTED: "rejected",
}
_KINDS = {name: value for value, name in KIND_NAMES.items()}
_STATES = {name: value for value, name in STATE_NAMES.items()}
_STATUSES = {name: value for value, name in STATUS_NAMES.items()}

LIST_DEFAULT, LIST_MAX = 100, 500
SEARCH_DEFAULT, SEARCH_MAX = 10, 50
CHANGESETS_DEFAULT, CHANGESETS_MAX = 20, 100
MAX_OPERATIONS = 100


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    """Seconds since the epoch as a protobuf ``Timestamp``."""
    stamp = timestamp_pb2.Timestamp()
    stamp.FromMicroseconds(round(seconds * 1e6))
    return stamp


def project_message(project: ProjectRecord) -> tracker_pb2.Project:
    """The proto of a project."""
    return tracker_pb2.Project(
        project_id=project.project_id,
        name=project.name,
        description=project.description,
        organization_id=project.organization_id,
        organization_name=project.organization_name,
        settings=project.settings,
    )


def item_message(item: ItemRecord) -> tracker_pb2.Item:
    """The proto of an item, dependencies included."""
    message = tracker_pb2.Item(
        item_id=item.item_id,
        project_id=item.project_id,
        kind=_KINDS[item.kind],
        title=item.title,
        description=item.description,
        acceptance_criteria=item.acceptance_criteria,
        state=_STATES[item.state],
        priority=item.priority,
        ticket_type=item.ticket_type,
        epic_id=item.epic_id,
        milestone_id=item.milestone_id,
        blocked_by_ids=item.blocked_by_ids,
        blocks_ids=item.blocks_ids,
        labels=item.labels,
        create_time=timestamp(item.create_time),
        update_time=timestamp(item.update_time),
    )
    if item.policy is not None:
        message.policy.CopyFrom(
            tracker_pb2.ExecutionPolicy(mode=item.policy.mode, settings=item.policy.settings)
        )
    return message


def changeset_message(changeset: ChangesetRecord) -> tracker_pb2.Changeset:
    """The proto of a changeset (operations parsed back from their stored JSON)."""
    return tracker_pb2.Changeset(
        changeset_id=changeset.changeset_id,
        project_id=changeset.project_id,
        status=_STATUSES[changeset.status],
        title=changeset.title,
        description=changeset.description,
        operations=[
            json_format.ParseDict(operation, tracker_pb2.ChangesetOperation())
            for operation in changeset.operations
        ],
        author_id=changeset.author_id,
        recorded_by=changeset.recorded_by,
        create_time=timestamp(changeset.create_time),
    )


def skill_hit(skill: SkillView) -> tracker_pb2.SkillHit:
    """The proto of a skill found by project search."""
    return tracker_pb2.SkillHit(
        name=skill.name, description=skill.description, version=skill.version
    )


def _enum(value: int, names: dict[Any, str], field: str) -> str:
    if value == 0:
        return ""
    if value not in names:
        raise InvalidArgument("INVALID_ENUM_VALUE", f"{field} has an unknown value {value}")
    return names[value]


class TrackerServicer(tracker_pb2_grpc.TrackerServiceServicer):
    """The tracker backend over the devstack store."""

    def __init__(self, store: Store, backend: Backend, pages: PageTokens) -> None:
        self._store = store
        self._rpc = backend
        self._pages = pages

    async def GetProject(
        self, request: tracker_pb2.GetProjectRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> tracker_pb2.GetProjectResponse:
        """The project, its settings and the caller's permissions; needs tracker.read."""

        async def work(caller: Caller) -> tracker_pb2.GetProjectResponse:
            async with self._store.read() as session:
                access = await _readable(session, caller, request.project_id)
            return tracker_pb2.GetProjectResponse(
                project=project_message(access.project), permissions=sorted(access.permissions)
            )

        return await self._rpc.run(context, "GetProject", work, project_id=request.project_id)

    async def ListItems(
        self, request: tracker_pb2.ListItemsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> tracker_pb2.ListItemsResponse:
        """A page of items by priority then id (AIP-158); needs tracker.read.

        INVALID_ARGUMENT for a negative page size, a bad page token or enum value;
        NOT_FOUND for an unknown project, epic or milestone filter.
        """

        async def work(caller: Caller) -> tracker_pb2.ListItemsResponse:
            size = page_size(request.page_size, default=LIST_DEFAULT, maximum=LIST_MAX)
            kind = _enum(request.kind, KIND_NAMES, "kind")
            state = _enum(request.state, STATE_NAMES, "state")
            filters = {
                "project": request.project_id,
                "kind": kind,
                "state": state,
                "epic": request.epic_id,
                "milestone": request.milestone_id,
            }
            position = self._pages.decode_page(request.page_token, "ListItems", filters)
            async with self._store.read() as session:
                await _readable(session, caller, request.project_id)
                page = await items_store.list_items(
                    session,
                    request.project_id,
                    kind=kind,
                    state=state,
                    epic_id=request.epic_id,
                    milestone_id=request.milestone_id,
                    after=_item_key(position),
                    limit=size,
                )
            return tracker_pb2.ListItemsResponse(
                items=[item_message(item) for item in page.items],
                next_page_token=self._next_item_token("ListItems", filters, page),
                total_size=page.total,
            )

        return await self._rpc.run(context, "ListItems", work, project_id=request.project_id)

    async def GetItem(
        self, request: tracker_pb2.GetItemRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> tracker_pb2.GetItemResponse:
        """One item with its dependencies; needs tracker.read; NOT_FOUND when not in the
        project (an item of another project is not found either)."""

        async def work(caller: Caller) -> tracker_pb2.GetItemResponse:
            if not request.item_id:
                raise InvalidArgument("ITEM_ID_REQUIRED", "item_id is required")
            async with self._store.read() as session:
                await _readable(session, caller, request.project_id)
                item = await items_store.get_item(session, request.project_id, request.item_id)
            return tracker_pb2.GetItemResponse(item=item_message(item))

        return await self._rpc.run(context, "GetItem", work, project_id=request.project_id)

    async def ListRunnableTickets(
        self,
        request: tracker_pb2.ListRunnableTicketsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> tracker_pb2.ListRunnableTicketsResponse:
        """A page of open tickets whose blockers are all closed; needs tracker.read."""

        async def work(caller: Caller) -> tracker_pb2.ListRunnableTicketsResponse:
            size = page_size(request.page_size, default=LIST_DEFAULT, maximum=LIST_MAX)
            filters = {"project": request.project_id}
            position = self._pages.decode_page(request.page_token, "ListRunnableTickets", filters)
            async with self._store.read() as session:
                await _readable(session, caller, request.project_id)
                page = await items_store.runnable_tickets(
                    session, request.project_id, after=_item_key(position), limit=size
                )
            return tracker_pb2.ListRunnableTicketsResponse(
                items=[item_message(item) for item in page.items],
                next_page_token=self._next_item_token("ListRunnableTickets", filters, page),
                total_size=page.total,
            )

        return await self._rpc.run(
            context, "ListRunnableTickets", work, project_id=request.project_id
        )

    async def SearchProject(
        self, request: tracker_pb2.SearchProjectRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> tracker_pb2.SearchProjectResponse:
        """Hybrid search: items with tracker.read, skills with skill.read, else
        PERMISSION_DENIED; INVALID_ARGUMENT for an empty query (docs/decisions/0103)."""

        async def work(caller: Caller) -> tracker_pb2.SearchProjectResponse:
            size = page_size(request.page_size, default=SEARCH_DEFAULT, maximum=SEARCH_MAX)
            if not request.query.strip():
                raise InvalidArgument("QUERY_REQUIRED", "query is required")
            filters = {"project": request.project_id, "query": request.query}
            position = self._pages.decode_page(request.page_token, "SearchProject", filters)
            offset = int(position["o"]) if position else 0
            async with self._store.read() as session:
                access = await project_access(
                    session,
                    human=caller.human,
                    organization_id=caller.organization_id,
                    project_id=request.project_id,
                )
                with_items = TRACKER_READ in access.permissions
                with_skills = SKILL_READ in access.permissions
                if not (with_items or with_skills):
                    raise PermissionDenied(
                        "PERMISSION_DENIED",
                        "searching a project needs tracker.read or skill.read",
                        {"permission": f"{TRACKER_READ}|{SKILL_READ}"},
                    )
                skills: list[SkillView] | None = None
                if with_skills:
                    skills = await effective_skills(
                        session,
                        org_id=access.project.organization_id,
                        project_id=request.project_id,
                    )
                hits, more = await items_store.search_project(
                    session,
                    self._store.dialect,
                    org_id=access.project.organization_id,
                    project_id=request.project_id,
                    query=request.query,
                    skills=skills,
                    include_items=with_items,
                    offset=offset,
                    limit=size,
                )
            results = []
            for hit in hits:
                result = tracker_pb2.SearchResult(score=hit.score, snippet=hit.snippet)
                if hit.item is not None:
                    result.item.CopyFrom(item_message(hit.item))
                elif hit.skill is not None:
                    result.skill.CopyFrom(skill_hit(hit.skill))
                results.append(result)
            token = (
                self._pages.encode("SearchProject", filters, {"o": offset + size}) if more else ""
            )
            return tracker_pb2.SearchProjectResponse(
                results=results,
                next_page_token=token,
                items_searched=with_items,
                skills_searched=with_skills,
            )

        return await self._rpc.run(context, "SearchProject", work, project_id=request.project_id)

    async def ListChangesets(
        self,
        request: tracker_pb2.ListChangesetsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> tracker_pb2.ListChangesetsResponse:
        """A page of the project's changesets, newest first; needs tracker.read."""

        async def work(caller: Caller) -> tracker_pb2.ListChangesetsResponse:
            size = page_size(request.page_size, default=CHANGESETS_DEFAULT, maximum=CHANGESETS_MAX)
            status = _enum(request.status, STATUS_NAMES, "status")
            filters = {"project": request.project_id, "status": status}
            position = self._pages.decode_page(request.page_token, "ListChangesets", filters)
            async with self._store.read() as session:
                await _readable(session, caller, request.project_id)
                records, more = await items_store.list_changesets(
                    session,
                    request.project_id,
                    status=status,
                    before_seq=int(position["s"]) if position else None,
                    limit=size,
                )
            token = ""
            if more and records:
                token = self._pages.encode("ListChangesets", filters, {"s": records[-1].seq})
            return tracker_pb2.ListChangesetsResponse(
                changesets=[changeset_message(record) for record in records],
                next_page_token=token,
            )

        return await self._rpc.run(context, "ListChangesets", work, project_id=request.project_id)

    async def ProposeChangeset(
        self,
        request: tracker_pb2.ProposeChangesetRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> tracker_pb2.ProposeChangesetResponse:
        """Store a PROPOSED changeset; needs tracker.write; idempotent on ``request_id``.

        Every item, epic and milestone named must be in the project (NOT_FOUND) or be the
        ``ref`` of an earlier create operation of the changeset (INVALID_ARGUMENT for an
        unknown ref or a wrong kind). The same ``request_id`` with the same payload returns
        the first changeset; with another payload INVALID_ARGUMENT/REQUEST_ID_REUSED (AIP-155).
        A planner-recorded call may not set an execution policy (PERMISSION_DENIED /
        POLICY_CHANGE_NOT_ALLOWED, docs/spec/authority.md). Author = the human; recorded by = the
        honoured actor, else the human.
        """

        async def work(caller: Caller) -> tracker_pb2.ProposeChangesetResponse:
            check_request_id(request.request_id)
            payload = tracker_pb2.ProposeChangesetRequest()
            payload.CopyFrom(request)
            payload.request_id = ""
            payload_hash = digest(payload.SerializeToString(deterministic=True))
            written = False

            async def unit(session: AsyncSession) -> ChangesetRecord:
                nonlocal written
                access = await project_access(
                    session,
                    human=caller.human,
                    organization_id=caller.organization_id,
                    project_id=request.project_id,
                )
                require(access.permissions, TRACKER_WRITE, where=f"project {request.project_id}")
                key = {"method": "ProposeChangeset", "human": caller.human}
                ref = await replay_ref(
                    session, **key, request_id=request.request_id, payload_hash=payload_hash
                )
                if ref is not None:
                    return await items_store.get_changeset(session, ref)
                await _validate_changeset(session, request, caller)
                record = await items_store.insert_changeset(
                    session,
                    project_id=request.project_id,
                    title=request.title,
                    description=request.description,
                    operations=[
                        json_format.MessageToDict(operation) for operation in request.operations
                    ],
                    author_id=caller.human,
                    recorded_by=caller.recorded_by,
                )
                await remember(
                    session,
                    **key,
                    request_id=request.request_id,
                    payload_hash=payload_hash,
                    result_ref=record.changeset_id,
                )
                written = True
                return record

            record = await self._store.run_write(unit)
            if written:
                self._rpc.note_write(request.request_id)
            return tracker_pb2.ProposeChangesetResponse(changeset=changeset_message(record))

        return await self._rpc.run(
            context,
            "ProposeChangeset",
            work,
            project_id=request.project_id,
            request_id=request.request_id,
        )

    def _next_item_token(self, listing: str, filters: dict[str, Any], page: ItemPage) -> str:
        if not page.more or not page.items:
            return ""
        last = page.items[-1]
        return self._pages.encode(listing, filters, {"p": last.priority, "i": last.item_id})


def _item_key(position: dict[str, Any] | None) -> items_store.ItemKey | None:
    if position is None:
        return None
    return int(position["p"]), str(position["i"])


async def _readable(session: AsyncSession, caller: Caller, project_id: str) -> Access:
    access = await project_access(
        session, human=caller.human, organization_id=caller.organization_id, project_id=project_id
    )
    require(access.permissions, TRACKER_READ, where=f"project {project_id}")
    return access


async def _validate_changeset(
    session: AsyncSession, request: tracker_pb2.ProposeChangesetRequest, caller: Caller
) -> None:
    """Check a changeset against the project before it is stored (see ProposeChangeset)."""
    if not request.title.strip():
        raise InvalidArgument("TITLE_REQUIRED", "a changeset needs a title")
    if not request.operations:
        raise InvalidArgument("OPERATIONS_REQUIRED", "a changeset needs at least one operation")
    if len(request.operations) > MAX_OPERATIONS:
        raise InvalidArgument("TOO_MANY_OPERATIONS", f"at most {MAX_OPERATIONS} operations")
    named: list[str] = []
    for operation in request.operations:
        which = operation.WhichOneof("operation")
        if which == "create_item":
            named += [operation.create_item.epic_id, operation.create_item.milestone_id]
        elif which == "update_item":
            update = operation.update_item
            named += [update.item_id, update.epic_id, update.milestone_id]
        elif which == "dependency":
            named += [operation.dependency.item_id, operation.dependency.blocked_by_id]
    existing = await items_store.item_kinds(session, request.project_id, filter(None, named))
    refs: dict[str, str] = {}

    def resolve(index: int, value: str, field: str, wanted: str | None = None) -> None:
        if value in refs:
            kind = refs[value]
        elif value in existing:
            kind = existing[value]
        else:
            raise NotFound(
                "ITEM_NOT_FOUND",
                f"operation {index}: {field} {value!r} is neither an item of project "
                f"{request.project_id!r} nor the ref of an earlier create operation",
                {"item_id": value, "operation": str(index), "field": field},
            )
        if wanted is not None and kind != wanted:
            raise InvalidArgument(
                f"NOT_A_{wanted.upper()}",
                f"operation {index}: {field} {value!r} is a {kind}, not a {wanted}",
                {"item_id": value, "operation": str(index), "field": field},
            )

    for index, operation in enumerate(request.operations):
        which = operation.WhichOneof("operation")
        if which is None:
            raise InvalidArgument("EMPTY_OPERATION", f"operation {index} sets no operation")
        policy_set = False
        if which == "create_item":
            create = operation.create_item
            kind = _enum(create.kind, KIND_NAMES, f"operation {index}: kind")
            if not kind:
                raise InvalidArgument("KIND_REQUIRED", f"operation {index}: kind is required")
            if not create.title.strip():
                raise InvalidArgument("TITLE_REQUIRED", f"operation {index}: title is required")
            _priority(index, create.priority)
            if create.epic_id:
                resolve(index, create.epic_id, "epic_id", "epic")
            if create.milestone_id:
                resolve(index, create.milestone_id, "milestone_id", "milestone")
            if create.ref:
                if create.ref in refs or create.ref in existing:
                    raise InvalidArgument(
                        "DUPLICATE_REF", f"operation {index}: ref {create.ref!r} is already used"
                    )
                refs[create.ref] = kind
            policy_set = create.HasField("policy")
        elif which == "update_item":
            update = operation.update_item
            resolve(index, update.item_id, "item_id")
            if update.HasField("state"):
                _enum(update.state, STATE_NAMES, f"operation {index}: state")
            if update.HasField("priority"):
                _priority(index, update.priority)
            if update.HasField("epic_id") and update.epic_id:
                resolve(index, update.epic_id, "epic_id", "epic")
            if update.HasField("milestone_id") and update.milestone_id:
                resolve(index, update.milestone_id, "milestone_id", "milestone")
            policy_set = update.HasField("policy")
        else:
            dependency = operation.dependency
            resolve(index, dependency.item_id, "item_id")
            resolve(index, dependency.blocked_by_id, "blocked_by_id")
            if dependency.item_id == dependency.blocked_by_id:
                raise InvalidArgument(
                    "SELF_DEPENDENCY", f"operation {index}: an item cannot block itself"
                )
        if policy_set and caller.is_planner:
            # Seed, Authority: "the planner cannot set execution policies"; the planner
            # refuses first, this is the backend's own guard.
            raise PermissionDenied(
                "POLICY_CHANGE_NOT_ALLOWED",
                f"operation {index}: only a human may set an execution policy",
                {"operation": str(index)},
            )


def _priority(index: int, priority: int) -> None:
    if not 0 <= priority <= 4:
        raise InvalidArgument(
            "INVALID_PRIORITY", f"operation {index}: priority must be 0 (highest) to 4 (lowest)"
        )
