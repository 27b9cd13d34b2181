"""Translation between the backends' messages (``ballet.tracker.v1``,
``ballet.skills.v1``, ``ballet.knowledge.v1``) and the core's types
(``service/core/backend_types.py``), one pair of functions per RPC; no I/O.

From a backend, what the wire allows is normalized (decision 0130): an enum number this
planner does not know is ``UNSPECIFIED``, an unset sub-message is an empty value, a
``Timestamp`` outside 0001-01-01..9999-12-31 or with invalid nanos is no time (None), a
NaN or infinite score is 0.0, and an operation or search hit of a kind this planner does
not know is dropped. To a backend, a number its field cannot hold (``int32``/``int64``)
is a ``ToolFailure`` (``INVALID_ARGUMENTS``) naming the field, never an error of the wire
encoding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from ballet.knowledge.v1 import knowledge_pb2
from ballet.skills.v1 import skills_pb2
from ballet.tracker.v1 import tracker_pb2

from service.core.backend_types import (
    Changeset,
    ChangesetOperation,
    ChangesetPage,
    ChangesetProposal,
    ChangesetQuery,
    ChangesetStatus,
    CreateItem,
    DependencyChange,
    ExecutionPolicy,
    Item,
    ItemKind,
    ItemPage,
    ItemQuery,
    ItemState,
    KnowledgeEntry,
    KnowledgeEntryChange,
    KnowledgeHit,
    KnowledgeHits,
    KnowledgeKind,
    KnowledgeSearch,
    NewKnowledgeEntry,
    ProjectHit,
    ProjectSearch,
    ProjectSearchResult,
    RunnableQuery,
    Skill,
    SkillContent,
    SkillMention,
    SkillPage,
    SkillQuery,
    SkillScope,
    UpdateItem,
)
from service.core.errors import ToolFailure

_ITEM_KINDS = {
    ItemKind.UNSPECIFIED: tracker_pb2.ITEM_KIND_UNSPECIFIED,
    ItemKind.MILESTONE: tracker_pb2.ITEM_KIND_MILESTONE,
    ItemKind.EPIC: tracker_pb2.ITEM_KIND_EPIC,
    ItemKind.TICKET: tracker_pb2.ITEM_KIND_TICKET,
}
_ITEM_STATES = {
    ItemState.UNSPECIFIED: tracker_pb2.ITEM_STATE_UNSPECIFIED,
    ItemState.OPEN: tracker_pb2.ITEM_STATE_OPEN,
    ItemState.IN_PROGRESS: tracker_pb2.ITEM_STATE_IN_PROGRESS,
    ItemState.BLOCKED: tracker_pb2.ITEM_STATE_BLOCKED,
    ItemState.CLOSED: tracker_pb2.ITEM_STATE_CLOSED,
}
_CHANGESET_STATUSES = {
    ChangesetStatus.UNSPECIFIED: tracker_pb2.CHANGESET_STATUS_UNSPECIFIED,
    ChangesetStatus.PROPOSED: tracker_pb2.CHANGESET_STATUS_PROPOSED,
    ChangesetStatus.APPLIED: tracker_pb2.CHANGESET_STATUS_APPLIED,
    ChangesetStatus.REJECTED: tracker_pb2.CHANGESET_STATUS_REJECTED,
}
_SKILL_SCOPES = {
    SkillScope.UNSPECIFIED: skills_pb2.SKILL_SCOPE_UNSPECIFIED,
    SkillScope.ORGANIZATION: skills_pb2.SKILL_SCOPE_ORGANIZATION,
    SkillScope.PROJECT: skills_pb2.SKILL_SCOPE_PROJECT,
}
_KNOWLEDGE_KINDS = {
    KnowledgeKind.UNSPECIFIED: knowledge_pb2.KNOWLEDGE_KIND_UNSPECIFIED,
    KnowledgeKind.DOCUMENT: knowledge_pb2.KNOWLEDGE_KIND_DOCUMENT,
    KnowledgeKind.DECISION: knowledge_pb2.KNOWLEDGE_KIND_DECISION,
    KnowledgeKind.NOTE: knowledge_pb2.KNOWLEDGE_KIND_NOTE,
    KnowledgeKind.DEBT: knowledge_pb2.KNOWLEDGE_KIND_DEBT,
}
_KIND_OF = {number: kind for kind, number in _ITEM_KINDS.items()}
_STATE_OF = {number: state for state, number in _ITEM_STATES.items()}
_STATUS_OF = {number: status for status, number in _CHANGESET_STATUSES.items()}
_SCOPE_OF = {number: scope for scope, number in _SKILL_SCOPES.items()}
_KNOWLEDGE_KIND_OF = {number: kind for kind, number in _KNOWLEDGE_KINDS.items()}

_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
# google.protobuf.Timestamp's calendar: 0001-01-01T00:00:00Z to 9999-12-31T23:59:59Z.
_FIRST_SECOND, _LAST_SECOND = -62_135_596_800, 253_402_300_799
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


# --------------------------------------------------------------------------- to the wire


def _integer(name: str, value: int, bounds: tuple[int, int]) -> int:
    low, high = bounds
    if not isinstance(value, int) or isinstance(value, bool):
        raise ToolFailure("INVALID_ARGUMENTS", f"{name} must be an integer")
    if not low <= value <= high:
        raise ToolFailure("INVALID_ARGUMENTS", f"{name} must be between {low} and {high}")
    return value


def list_items_request(query: ItemQuery) -> tracker_pb2.ListItemsRequest:
    """``ListItems``; raises ``ToolFailure`` for a ``page_size`` beyond int32."""
    return tracker_pb2.ListItemsRequest(
        project_id=query.project_id,
        kind=_ITEM_KINDS[query.kind or ItemKind.UNSPECIFIED],
        state=_ITEM_STATES[query.state or ItemState.UNSPECIFIED],
        epic_id=query.epic_id,
        milestone_id=query.milestone_id,
        page_size=_integer("page_size", query.page_size, _INT32),
        page_token=query.page_token,
    )


def list_runnable_request(query: RunnableQuery) -> tracker_pb2.ListRunnableTicketsRequest:
    """``ListRunnableTickets``; raises ``ToolFailure`` for a ``page_size`` beyond int32."""
    return tracker_pb2.ListRunnableTicketsRequest(
        project_id=query.project_id,
        page_size=_integer("page_size", query.page_size, _INT32),
        page_token=query.page_token,
    )


def search_project_request(search: ProjectSearch) -> tracker_pb2.SearchProjectRequest:
    """``SearchProject``; raises ``ToolFailure`` for a ``limit`` beyond int32."""
    return tracker_pb2.SearchProjectRequest(
        project_id=search.project_id,
        query=search.query,
        page_size=_integer("limit", search.limit, _INT32),
    )


def list_changesets_request(query: ChangesetQuery) -> tracker_pb2.ListChangesetsRequest:
    """``ListChangesets``; raises ``ToolFailure`` for a ``page_size`` beyond int32."""
    return tracker_pb2.ListChangesetsRequest(
        project_id=query.project_id,
        status=_CHANGESET_STATUSES[query.status or ChangesetStatus.UNSPECIFIED],
        page_size=_integer("page_size", query.page_size, _INT32),
        page_token=query.page_token,
    )


def _operation_message(operation: ChangesetOperation) -> tracker_pb2.ChangesetOperation:
    # Field by field into messages whose policy stays unset: the domain types have no
    # policy, and nothing else reaches the tracker (docs/spec/authority.md).
    if isinstance(operation, CreateItem):
        return tracker_pb2.ChangesetOperation(
            create_item=tracker_pb2.CreateItemOperation(
                ref=operation.ref,
                kind=_ITEM_KINDS[operation.kind],
                title=operation.title,
                description=operation.description,
                acceptance_criteria=operation.acceptance_criteria,
                priority=_integer("priority", operation.priority, _INT32),
                ticket_type=operation.ticket_type,
                epic_id=operation.epic_id,
                milestone_id=operation.milestone_id,
            )
        )
    if isinstance(operation, UpdateItem):
        priority = operation.priority
        return tracker_pb2.ChangesetOperation(
            update_item=tracker_pb2.UpdateItemOperation(
                item_id=operation.item_id,
                title=operation.title,
                description=operation.description,
                acceptance_criteria=operation.acceptance_criteria,
                state=None if operation.state is None else _ITEM_STATES[operation.state],
                priority=None if priority is None else _integer("priority", priority, _INT32),
                epic_id=operation.epic_id,
                milestone_id=operation.milestone_id,
            )
        )
    return tracker_pb2.ChangesetOperation(
        dependency=tracker_pb2.DependencyOperation(
            item_id=operation.item_id,
            blocked_by_id=operation.blocked_by_id,
            remove=operation.remove,
        )
    )


def propose_changeset_request(proposal: ChangesetProposal) -> tracker_pb2.ProposeChangesetRequest:
    """``ProposeChangeset``; raises ``ToolFailure`` for a ``priority`` beyond int32."""
    return tracker_pb2.ProposeChangesetRequest(
        request_id=proposal.request_id,
        project_id=proposal.project_id,
        title=proposal.title,
        description=proposal.description,
        operations=[_operation_message(operation) for operation in proposal.operations],
    )


def list_skills_request(query: SkillQuery) -> skills_pb2.ListSkillsRequest:
    """``ListSkills``; raises ``ToolFailure`` for a ``page_size`` beyond int32."""
    return skills_pb2.ListSkillsRequest(
        project_id=query.project_id,
        page_size=_integer("page_size", query.page_size, _INT32),
        page_token=query.page_token,
    )


def search_knowledge_request(search: KnowledgeSearch) -> knowledge_pb2.SearchKnowledgeRequest:
    """``SearchKnowledge``; raises ``ToolFailure`` for a ``limit`` beyond int32."""
    return knowledge_pb2.SearchKnowledgeRequest(
        query=search.query,
        kind=_KNOWLEDGE_KINDS[search.kind or KnowledgeKind.UNSPECIFIED],
        page_size=_integer("limit", search.limit, _INT32),
    )


def create_knowledge_request(
    entry: NewKnowledgeEntry,
) -> knowledge_pb2.CreateKnowledgeEntryRequest:
    """``CreateKnowledgeEntry``, with the planner's call id as ``request_id``."""
    return knowledge_pb2.CreateKnowledgeEntryRequest(
        request_id=entry.request_id,
        kind=_KNOWLEDGE_KINDS[entry.kind],
        title=entry.title,
        body=entry.body,
        status=entry.status,
        project_id=entry.project_id,
        item_ids=list(entry.item_ids),
    )


def update_knowledge_request(
    change: KnowledgeEntryChange,
) -> knowledge_pb2.UpdateKnowledgeEntryRequest:
    """``UpdateKnowledgeEntry``; raises ``ToolFailure`` for a ``version`` beyond int64."""
    return knowledge_pb2.UpdateKnowledgeEntryRequest(
        request_id=change.request_id,
        entry_id=change.entry_id,
        version=_integer("version", change.version, _INT64),
        title=change.title,
        body=change.body,
        status=change.status,
        item_ids=list(change.item_ids or ()),
        # An explicit list, even an empty one, replaces the links (the contract's rule).
        replace_item_ids=change.item_ids is not None,
    )


# --------------------------------------------------------------------------- from the wire


def _time(message: Any, field: str) -> datetime | None:
    if not message.HasField(field):
        return None
    stamp = getattr(message, field)
    if not (_FIRST_SECOND <= stamp.seconds <= _LAST_SECOND and 0 <= stamp.nanos < 10**9):
        return None
    return _EPOCH + timedelta(seconds=stamp.seconds, microseconds=stamp.nanos // 1000)


def _score(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def item(message: tracker_pb2.Item) -> Item:
    """An item as the core sees it (times, enums and the policy normalized)."""
    policy = None
    if message.HasField("policy"):
        # Map order is not defined on the wire; sorted, the output is the same every time.
        settings = dict(sorted(message.policy.settings.items()))
        policy = ExecutionPolicy(mode=message.policy.mode, settings=settings)
    return Item(
        item_id=message.item_id,
        kind=_KIND_OF.get(message.kind, ItemKind.UNSPECIFIED),
        title=message.title,
        state=_STATE_OF.get(message.state, ItemState.UNSPECIFIED),
        priority=message.priority,
        ticket_type=message.ticket_type,
        epic_id=message.epic_id,
        milestone_id=message.milestone_id,
        labels=tuple(message.labels),
        description=message.description,
        acceptance_criteria=message.acceptance_criteria,
        blocked_by_ids=tuple(message.blocked_by_ids),
        blocks_ids=tuple(message.blocks_ids),
        policy=policy,
        create_time=_time(message, "create_time"),
        update_time=_time(message, "update_time"),
    )


def item_page(items: Iterable[tracker_pb2.Item], next_page_token: str, total_size: int) -> ItemPage:
    return ItemPage(
        items=tuple(map(item, items)), next_page_token=next_page_token, total_size=total_size
    )


def project_search_result(response: tracker_pb2.SearchProjectResponse) -> ProjectSearchResult:
    """Search hits with finite scores; a hit of no known kind is dropped."""
    hits: list[ProjectHit] = []
    for hit in response.results:
        which = hit.WhichOneof("hit")
        if which == "item":
            hits.append(ProjectHit(_score(hit.score), hit.snippet, item=item(hit.item)))
        elif which == "skill":
            found = SkillMention(hit.skill.name, hit.skill.description, hit.skill.version)
            hits.append(ProjectHit(_score(hit.score), hit.snippet, skill=found))
    return ProjectSearchResult(
        hits=tuple(hits),
        items_searched=response.items_searched,
        skills_searched=response.skills_searched,
    )


def _operation(message: tracker_pb2.ChangesetOperation) -> ChangesetOperation | None:
    which = message.WhichOneof("operation")
    if which == "create_item":
        create = message.create_item
        return CreateItem(
            kind=_KIND_OF.get(create.kind, ItemKind.UNSPECIFIED),
            title=create.title,
            priority=create.priority,
            ref=create.ref,
            description=create.description,
            acceptance_criteria=create.acceptance_criteria,
            ticket_type=create.ticket_type,
            epic_id=create.epic_id,
            milestone_id=create.milestone_id,
        )
    if which == "update_item":
        update = message.update_item
        has = update.HasField
        return UpdateItem(
            item_id=update.item_id,
            title=update.title if has("title") else None,
            description=update.description if has("description") else None,
            acceptance_criteria=update.acceptance_criteria if has("acceptance_criteria") else None,
            state=_STATE_OF.get(update.state, ItemState.UNSPECIFIED) if has("state") else None,
            priority=update.priority if has("priority") else None,
            epic_id=update.epic_id if has("epic_id") else None,
            milestone_id=update.milestone_id if has("milestone_id") else None,
        )
    if which == "dependency":
        dependency = message.dependency
        return DependencyChange(
            item_id=dependency.item_id,
            blocked_by_id=dependency.blocked_by_id,
            remove=dependency.remove,
        )
    return None


def changeset(message: tracker_pb2.Changeset) -> Changeset:
    """A changeset; operations of a kind this planner does not know are dropped."""
    operations = (_operation(operation) for operation in message.operations)
    return Changeset(
        changeset_id=message.changeset_id,
        status=_STATUS_OF.get(message.status, ChangesetStatus.UNSPECIFIED),
        title=message.title,
        description=message.description,
        author_id=message.author_id,
        recorded_by=message.recorded_by,
        operations=tuple(operation for operation in operations if operation is not None),
        create_time=_time(message, "create_time"),
    )


def changeset_page(response: tracker_pb2.ListChangesetsResponse) -> ChangesetPage:
    return ChangesetPage(
        changesets=tuple(map(changeset, response.changesets)),
        next_page_token=response.next_page_token,
    )


def skill(message: skills_pb2.Skill) -> Skill:
    return Skill(
        name=message.name,
        description=message.description,
        scope=_SCOPE_OF.get(message.scope, SkillScope.UNSPECIFIED),
        version=message.version,
        pinned=message.pinned,
        latest_version=message.latest_version,
    )


def skill_page(response: skills_pb2.ListSkillsResponse) -> SkillPage:
    return SkillPage(
        skills=tuple(map(skill, response.skills)), next_page_token=response.next_page_token
    )


def skill_content(response: skills_pb2.ReadSkillResponse) -> SkillContent:
    return SkillContent(skill=skill(response.skill), content=response.content)


def knowledge_entry(message: knowledge_pb2.KnowledgeEntry) -> KnowledgeEntry:
    """A knowledge entry (an unset message gives an empty one)."""
    return KnowledgeEntry(
        entry_id=message.entry_id,
        kind=_KNOWLEDGE_KIND_OF.get(message.kind, KnowledgeKind.UNSPECIFIED),
        title=message.title,
        status=message.status,
        version=message.version,
        author_id=message.author_id,
        recorded_by=message.recorded_by,
        project_ids=tuple(message.project_ids),
        item_ids=tuple(message.item_ids),
        body=message.body,
        supersedes_ids=tuple(message.supersedes_ids),
        superseded_by_ids=tuple(message.superseded_by_ids),
        create_time=_time(message, "create_time"),
        update_time=_time(message, "update_time"),
    )


def knowledge_hits(response: knowledge_pb2.SearchKnowledgeResponse) -> KnowledgeHits:
    return KnowledgeHits(
        hits=tuple(
            KnowledgeHit(knowledge_entry(hit.entry), _score(hit.score), hit.snippet)
            for hit in response.hits
        ),
        next_page_token=response.next_page_token,
    )
