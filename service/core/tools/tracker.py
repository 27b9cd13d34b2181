"""The tracker's six tools (docs/spec/turn-loop.md): ``list_items``, ``get_item``,
``list_runnable``,
``search_project``, ``list_changesets`` and ``propose_changeset``.

Each is one ``Tool``: its schema and description, then its run function (arguments ->
``TrackerService`` call through the ``ToolBackends`` port -> our output shape), side by
side. The planner fills in the session's project; no schema takes one (docs/spec/authority.md).
"""

from __future__ import annotations

from typing import Any

from service.core.backend_types import (
    Changeset,
    ChangesetOperation,
    ChangesetProposal,
    ChangesetQuery,
    ChangesetStatus,
    CreateItem,
    DependencyChange,
    Item,
    ItemKind,
    ItemPage,
    ItemQuery,
    ItemState,
    ProjectSearch,
    RunnableQuery,
    UpdateItem,
)
from service.core.errors import ToolFailure
from service.core.model import JsonObject
from service.core.tools.unit import (
    PAGE_TOKEN,
    SKILL_READ,
    TEXT_CHARS,
    TITLE_CHARS,
    TRACKER_READ,
    TRACKER_WRITE,
    Invocation,
    Tool,
    ToolResult,
    enum,
    integer,
    object_schema,
    score,
    set_time,
    string,
)

#: Page sizes when the model gives none: small enough that a page of compact results
#: stays under the 16 KiB cut (docs/spec/turn-loop.md step 5), so page tokens stay usable.
DEFAULT_ITEMS_PAGE = 50
DEFAULT_CHANGESETS_PAGE = 10
DEFAULT_SEARCH_LIMIT = 10
#: A created item's priority when the model gives none (the middle of 0 to 4).
DEFAULT_PRIORITY = 2

_KINDS = tuple(kind.value for kind in ItemKind if kind is not ItemKind.UNSPECIFIED)
_STATES = tuple(state.value for state in ItemState if state is not ItemState.UNSPECIFIED)
_STATUSES = tuple(s.value for s in ChangesetStatus if s is not ChangesetStatus.UNSPECIFIED)


def _compact_item(item: Item) -> JsonObject:
    output: JsonObject = {
        "item_id": item.item_id,
        "kind": item.kind.value,
        "title": item.title,
        "state": item.state.value,
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


def _item_page(page: ItemPage) -> ToolResult:
    output: JsonObject = {"items": [_compact_item(item) for item in page.items]}
    # Proto3 cannot tell "0" from "unknown"; 0 next to items means the backend did not say.
    if page.total_size or not output["items"]:
        output["total_size"] = page.total_size
    if page.next_page_token:
        output["next_page_token"] = page.next_page_token
    return ToolResult(output)


# --------------------------------------------------------------------------- list_items


async def _list_items(call: Invocation, args: JsonObject) -> ToolResult:
    query = ItemQuery(
        project_id=call.project_id,
        page_size=args.get("page_size", DEFAULT_ITEMS_PAGE),
        kind=ItemKind(args["kind"]) if "kind" in args else None,
        state=ItemState(args["state"]) if "state" in args else None,
        epic_id=args.get("epic_id", ""),
        milestone_id=args.get("milestone_id", ""),
        page_token=args.get("page_token", ""),
    )
    return _item_page(await call.backends.list_items(call.acting, query, call.timeout_s))


LIST_ITEMS = Tool(
    name="list_items",
    description=(
        "List the project's milestones, epics and tickets (no text), by priority (0 is "
        "the highest) then id, optionally filtered. get_item gives an item's text."
    ),
    schema=object_schema(
        {
            "kind": enum("", *_KINDS),
            "state": enum("", *_STATES),
            "epic_id": string(""),
            "milestone_id": string(""),
            "page_size": integer("", 1, 500),
            "page_token": PAGE_TOKEN,
        }
    ),
    permissions=(TRACKER_READ,),
    rpcs=("TrackerService.ListItems",),
    run=_list_items,
)


# --------------------------------------------------------------------------- get_item


async def _get_item(call: Invocation, args: JsonObject) -> ToolResult:
    item = await call.backends.get_item(
        call.acting, call.project_id, args["item_id"], call.timeout_s
    )
    return ToolResult({"item": full_item(item)})


def full_item(item: Item) -> JsonObject:
    """The ``item`` of ``get_item``'s output: the compact item, its text, dependencies,
    policy and times."""
    output = _compact_item(item)
    output["description"] = item.description
    output["acceptance_criteria"] = item.acceptance_criteria
    output["blocked_by_ids"] = list(item.blocked_by_ids)
    output["blocks_ids"] = list(item.blocks_ids)
    if item.policy is not None:
        output["policy"] = {"mode": item.policy.mode, "settings": dict(item.policy.settings)}
    set_time(output, "create_time", item.create_time)
    set_time(output, "update_time", item.update_time)
    return output


GET_ITEM = Tool(
    name="get_item",
    description=(
        "Get one item with its description, acceptance criteria, dependencies "
        "(blocked_by_ids: the items blocking it; blocks_ids: the items it blocks) and "
        "execution policy (read only: only humans set it)."
    ),
    schema=object_schema({"item_id": string("")}, "item_id"),
    permissions=(TRACKER_READ,),
    rpcs=("TrackerService.GetItem",),
    run=_get_item,
)


# --------------------------------------------------------------------------- list_runnable


async def _list_runnable(call: Invocation, args: JsonObject) -> ToolResult:
    query = RunnableQuery(
        project_id=call.project_id,
        page_size=args.get("page_size", DEFAULT_ITEMS_PAGE),
        page_token=args.get("page_token", ""),
    )
    page = await call.backends.list_runnable_tickets(call.acting, query, call.timeout_s)
    return _item_page(page)


LIST_RUNNABLE = Tool(
    name="list_runnable",
    description=(
        "List the tickets ready to work on (open, every blocker closed), by priority "
        "then id: what can be done next."
    ),
    schema=object_schema(
        {
            "page_size": integer("", 1, 500),
            "page_token": PAGE_TOKEN,
        }
    ),
    permissions=(TRACKER_READ,),
    rpcs=("TrackerService.ListRunnableTickets",),
    run=_list_runnable,
)


# --------------------------------------------------------------------------- search_project


async def _search_project(call: Invocation, args: JsonObject) -> ToolResult:
    search = ProjectSearch(
        project_id=call.project_id,
        query=args["query"],
        limit=args.get("limit", DEFAULT_SEARCH_LIMIT),
    )
    found = await call.backends.search_project(call.acting, search, call.timeout_s)
    if not (found.items_searched or found.skills_searched):
        # docs/spec/authority.md: with neither tracker.read nor skill.read it is a refusal.
        raise ToolFailure(
            "PERMISSION_DENIED", "the human may read neither the tracker nor the skills"
        )
    results: list[JsonObject] = []
    for hit in found.hits:
        entry: JsonObject
        if hit.item is not None:
            entry = {"item": _compact_item(hit.item)}
        elif hit.skill is not None:
            skill = hit.skill
            entry = {
                "skill": {
                    "name": skill.name,
                    "description": skill.description,
                    "version": skill.version,
                }
            }
        else:
            continue
        entry["score"] = score(hit.score)
        entry["snippet"] = hit.snippet
        results.append(entry)
    output: JsonObject = {
        "results": results,
        "items_searched": found.items_searched,
        "skills_searched": found.skills_searched,
    }
    return ToolResult(output)


SEARCH_PROJECT = Tool(
    name="search_project",
    description=(
        "Search the project's items and skills by meaning and keywords, best first: to "
        "find an item whose id you do not know, or the skill for a topic."
    ),
    schema=object_schema(
        {
            "query": string("", max_length=1000),
            "limit": integer("Default 10.", 1, 50),
        },
        "query",
    ),
    permissions=(TRACKER_READ, SKILL_READ),
    rpcs=("TrackerService.SearchProject",),
    run=_search_project,
)


# --------------------------------------------------------------------------- changesets


def _operation_json(operation: ChangesetOperation) -> JsonObject:
    # The same shapes propose_changeset takes; a policy a human set is never shown.
    if isinstance(operation, CreateItem):
        fields: JsonObject = {
            "kind": operation.kind.value,
            "title": operation.title,
            "priority": operation.priority,
        }
        for name, text in (
            ("ref", operation.ref),
            ("description", operation.description),
            ("acceptance_criteria", operation.acceptance_criteria),
            ("ticket_type", operation.ticket_type),
            ("epic_id", operation.epic_id),
            ("milestone_id", operation.milestone_id),
        ):
            if text:
                fields[name] = text
        return {"create_item": fields}
    if isinstance(operation, UpdateItem):
        fields = {"item_id": operation.item_id}
        changed: tuple[tuple[str, Any], ...] = (
            ("title", operation.title),
            ("description", operation.description),
            ("acceptance_criteria", operation.acceptance_criteria),
            ("priority", operation.priority),
            ("epic_id", operation.epic_id),
            ("milestone_id", operation.milestone_id),
        )
        for name, value in changed:
            if value is not None:
                fields[name] = value
        if operation.state is not None:
            fields["state"] = operation.state.value
        return {"update_item": fields}
    key = "remove_dependency" if operation.remove else "add_dependency"
    return {key: {"item_id": operation.item_id, "blocked_by_id": operation.blocked_by_id}}


def _changeset(changeset: Changeset) -> JsonObject:
    output: JsonObject = {
        "changeset_id": changeset.changeset_id,
        "status": changeset.status.value,
        "title": changeset.title,
    }
    if changeset.description:
        output["description"] = changeset.description
    output["author_id"] = changeset.author_id
    output["recorded_by"] = changeset.recorded_by
    set_time(output, "create_time", changeset.create_time)
    output["operations"] = [_operation_json(operation) for operation in changeset.operations]
    return output


async def _list_changesets(call: Invocation, args: JsonObject) -> ToolResult:
    query = ChangesetQuery(
        project_id=call.project_id,
        page_size=args.get("page_size", DEFAULT_CHANGESETS_PAGE),
        status=ChangesetStatus(args["status"]) if "status" in args else None,
        page_token=args.get("page_token", ""),
    )
    page = await call.backends.list_changesets(call.acting, query, call.timeout_s)
    output: JsonObject = {"changesets": [_changeset(c) for c in page.changesets]}
    if page.next_page_token:
        output["next_page_token"] = page.next_page_token
    return ToolResult(output)


LIST_CHANGESETS = Tool(
    name="list_changesets",
    description=(
        "List the project's changesets (proposed plan changes), newest first. Check it "
        "before proposing, so as not to propose a change twice."
    ),
    schema=object_schema(
        {
            "status": enum("proposed: waiting for a human.", *_STATUSES),
            "page_size": integer("", 1, 100),
            "page_token": PAGE_TOKEN,
        }
    ),
    permissions=(TRACKER_READ,),
    rpcs=("TrackerService.ListChangesets",),
    run=_list_changesets,
)


# --------------------------------------------------------------------------- propose_changeset

_CREATE_ITEM = object_schema(
    {
        "ref": string("Your name for the new item, usable as its id later on.", max_length=64),
        "kind": enum("", *_KINDS),
        "title": string("", max_length=TITLE_CHARS),
        "description": string("Markdown.", max_length=TEXT_CHARS, min_length=0),
        "acceptance_criteria": string("", max_length=TEXT_CHARS, min_length=0),
        "priority": integer("0 (highest) to 4; default 2.", 0, 4),
        "ticket_type": string("For a ticket: task, bug, feature or chore.", max_length=32),
        "epic_id": string("For a ticket: its epic."),
        "milestone_id": string(""),
    },
    "kind",
    "title",
)
_UPDATE_ITEM = object_schema(
    {
        "item_id": string(""),
        "title": string("", max_length=TITLE_CHARS),
        "description": string("", max_length=TEXT_CHARS, min_length=0),
        "acceptance_criteria": string("", max_length=TEXT_CHARS, min_length=0),
        "state": enum("", *_STATES),
        "priority": integer("0 (highest) to 4.", 0, 4),
        "epic_id": string(""),
        "milestone_id": string(""),
    },
    "item_id",
    # Only the id would be an update that changes nothing.
    minProperties=2,
)
_ADD_DEPENDENCY = object_schema(
    {
        "item_id": string("The blocked item."),
        "blocked_by_id": string("The item blocking it."),
    },
    "item_id",
    "blocked_by_id",
)
_REMOVE_DEPENDENCY = object_schema(
    {"item_id": string(""), "blocked_by_id": string("")}, "item_id", "blocked_by_id"
)
# One key per operation instead of a oneOf: a validation error then names the exact
# field, which the model can fix, rather than "not valid under any of the given schemas".
_OPERATION = object_schema(
    {
        "create_item": _CREATE_ITEM,
        "update_item": _UPDATE_ITEM,
        "add_dependency": _ADD_DEPENDENCY,
        "remove_dependency": _REMOVE_DEPENDENCY,
    },
    minProperties=1,
    maxProperties=1,
    description="Exactly one key.",
)


def _operation(operation: JsonObject) -> ChangesetOperation:
    """One operation of the arguments (``_OPERATION``) as a domain operation.

    Fields are copied by name, one by one, into types that have no policy field: nothing
    the schema does not name (an execution policy above all; docs/spec/authority.md) can reach
    the tracker.
    """
    if "create_item" in operation:
        create = operation["create_item"]
        return CreateItem(
            kind=ItemKind(create["kind"]),
            title=create["title"],
            priority=create.get("priority", DEFAULT_PRIORITY),
            ref=create.get("ref", ""),
            description=create.get("description", ""),
            acceptance_criteria=create.get("acceptance_criteria", ""),
            ticket_type=create.get("ticket_type", ""),
            epic_id=create.get("epic_id", ""),
            milestone_id=create.get("milestone_id", ""),
        )
    if "update_item" in operation:
        update = operation["update_item"]
        state = update.get("state")
        return UpdateItem(
            item_id=update["item_id"],
            title=update.get("title"),
            description=update.get("description"),
            acceptance_criteria=update.get("acceptance_criteria"),
            state=ItemState(state) if state is not None else None,
            priority=update.get("priority"),
            epic_id=update.get("epic_id"),
            milestone_id=update.get("milestone_id"),
        )
    remove = "remove_dependency" in operation
    dependency = operation["remove_dependency" if remove else "add_dependency"]
    return DependencyChange(
        item_id=dependency["item_id"], blocked_by_id=dependency["blocked_by_id"], remove=remove
    )


async def _propose_changeset(call: Invocation, args: JsonObject) -> ToolResult:
    proposal = ChangesetProposal(
        request_id=call.request_id,
        project_id=call.project_id,
        title=args["title"],
        description=args.get("description", ""),
        operations=tuple(_operation(operation) for operation in args["operations"]),
    )
    changeset = await call.backends.propose_changeset(call.acting, proposal, call.timeout_s)
    return ToolResult({"changeset": _changeset(changeset)}, changeset_id=changeset.changeset_id)


PROPOSE_CHANGESET = Tool(
    name="propose_changeset",
    description=(
        "Propose plan changes, applied in order. Nothing changes until a human approves "
        "and applies them: tell the human what you proposed and that it waits for their "
        "approval. An item id may be the ref of an item created earlier in the changeset; "
        "update_item changes only the fields given."
    ),
    schema=object_schema(
        {
            "title": string("One line.", max_length=TITLE_CHARS),
            "description": string("Why.", max_length=TEXT_CHARS, min_length=0),
            "operations": {
                "type": "array",
                "items": _OPERATION,
                "minItems": 1,
                "maxItems": 50,
            },
        },
        "title",
        "operations",
    ),
    permissions=(TRACKER_WRITE,),
    rpcs=("TrackerService.ProposeChangeset",),
    run=_propose_changeset,
    is_write=True,
)

TOOLS = (
    LIST_ITEMS,
    GET_ITEM,
    LIST_RUNNABLE,
    SEARCH_PROJECT,
    LIST_CHANGESETS,
    PROPOSE_CHANGESET,
)
