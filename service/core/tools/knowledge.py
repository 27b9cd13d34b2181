"""The knowledge backend's four tools (docs/spec/turn-loop.md): ``search_knowledge``,
``get_knowledge``, ``create_knowledge`` and ``update_knowledge``.

Each is one ``Tool``: schema and description, then its run function (arguments ->
``KnowledgeService`` call through the ``ToolBackends`` port -> our output shape).
Knowledge is organization-wide (docs/spec/turn-loop.md); what the planner writes is linked to the
session's project and attributed to the human (docs/spec/authority.md).
"""

from __future__ import annotations

from service.core.backend_types import (
    KnowledgeEntry,
    KnowledgeEntryChange,
    KnowledgeKind,
    KnowledgeSearch,
    NewKnowledgeEntry,
)
from service.core.model import JsonObject
from service.core.tools.unit import (
    BODY_CHARS,
    INT64_MAX,
    KNOWLEDGE_READ,
    KNOWLEDGE_WRITE,
    TITLE_CHARS,
    Invocation,
    Tool,
    ToolResult,
    enum,
    id_list,
    integer,
    object_schema,
    score,
    set_time,
    string,
)

#: Search hits when the model gives no limit.
DEFAULT_SEARCH_LIMIT = 10

_KINDS = tuple(kind.value for kind in KnowledgeKind if kind is not KnowledgeKind.UNSPECIFIED)


def _entry_head(entry: KnowledgeEntry) -> JsonObject:
    return {
        "entry_id": entry.entry_id,
        "kind": entry.kind.value,
        "title": entry.title,
        "status": entry.status,
        "version": entry.version,
        "author_id": entry.author_id,
        "recorded_by": entry.recorded_by,
        "project_ids": list(entry.project_ids),
        "item_ids": list(entry.item_ids),
    }


def _written(entry: KnowledgeEntry) -> ToolResult:
    return ToolResult(
        {"entry": _entry_head(entry)},
        knowledge_entry_id=entry.entry_id,
        knowledge_version=entry.version,
    )


# --------------------------------------------------------------------------- search_knowledge


async def _search_knowledge(call: Invocation, args: JsonObject) -> ToolResult:
    search = KnowledgeSearch(
        query=args["query"],
        limit=args.get("limit", DEFAULT_SEARCH_LIMIT),
        kind=KnowledgeKind(args["kind"]) if "kind" in args else None,
    )
    found = await call.backends.search_knowledge(call.acting, search, call.timeout_s)
    hits: list[JsonObject] = []
    for hit in found.hits:
        entry = _entry_head(hit.entry)
        set_time(entry, "update_time", hit.entry.update_time)
        entry["score"] = score(hit.score)
        entry["snippet"] = hit.snippet
        hits.append(entry)
    output: JsonObject = {"hits": hits}
    if found.next_page_token:
        output["next_page_token"] = found.next_page_token
    return ToolResult(output)


SEARCH_KNOWLEDGE = Tool(
    name="search_knowledge",
    description=(
        "Search the organization's knowledge base (documents, decisions, notes, "
        "technical-debt records), best first; an empty query lists the newest entries. "
        "get_knowledge reads an entry's body."
    ),
    schema=object_schema(
        {
            "query": string("", max_length=1000, min_length=0),
            "kind": enum("", *_KINDS),
            "limit": integer("Default 10.", 1, 50),
        },
        "query",
    ),
    permissions=(KNOWLEDGE_READ,),
    rpcs=("KnowledgeService.SearchKnowledge",),
    run=_search_knowledge,
)


# --------------------------------------------------------------------------- get_knowledge


async def _get_knowledge(call: Invocation, args: JsonObject) -> ToolResult:
    entry = await call.backends.get_knowledge_entry(call.acting, args["entry_id"], call.timeout_s)
    output = _entry_head(entry)
    output["body"] = entry.body
    output["supersedes_ids"] = list(entry.supersedes_ids)
    output["superseded_by_ids"] = list(entry.superseded_by_ids)
    set_time(output, "create_time", entry.create_time)
    set_time(output, "update_time", entry.update_time)
    return ToolResult({"entry": output})


GET_KNOWLEDGE = Tool(
    name="get_knowledge",
    description="Read one knowledge entry with its body; update_knowledge needs its version.",
    schema=object_schema({"entry_id": string("")}, "entry_id"),
    permissions=(KNOWLEDGE_READ,),
    rpcs=("KnowledgeService.GetKnowledgeEntry",),
    run=_get_knowledge,
)


# --------------------------------------------------------------------------- create_knowledge


async def _create_knowledge(call: Invocation, args: JsonObject) -> ToolResult:
    new = NewKnowledgeEntry(
        request_id=call.request_id,
        project_id=call.project_id,
        kind=KnowledgeKind(args["kind"]),
        title=args["title"],
        body=args["body"],
        status=args.get("status", ""),
        item_ids=tuple(args.get("item_ids", ())),
    )
    return _written(await call.backends.create_knowledge_entry(call.acting, new, call.timeout_s))


CREATE_KNOWLEDGE = Tool(
    name="create_knowledge",
    description=(
        "Write a new knowledge entry, linked to this project and optionally to its items. "
        "It is attributed to the human: write only what they asked for or agreed to."
    ),
    schema=object_schema(
        {
            "kind": enum("", *_KINDS),
            "title": string("", max_length=TITLE_CHARS),
            "body": string("Markdown.", max_length=BODY_CHARS),
            "status": string("E.g. proposed or accepted for a decision.", max_length=32),
            "item_ids": id_list("Items to link."),
        },
        "kind",
        "title",
        "body",
    ),
    permissions=(KNOWLEDGE_WRITE,),
    rpcs=("KnowledgeService.CreateKnowledgeEntry",),
    run=_create_knowledge,
    is_write=True,
)


# --------------------------------------------------------------------------- update_knowledge


async def _update_knowledge(call: Invocation, args: JsonObject) -> ToolResult:
    change = KnowledgeEntryChange(
        request_id=call.request_id,
        entry_id=args["entry_id"],
        version=args["version"],
        title=args.get("title"),
        body=args.get("body"),
        status=args.get("status"),
        # An explicit list, even an empty one, replaces the links (the contract's rule).
        item_ids=tuple(args["item_ids"]) if "item_ids" in args else None,
    )
    entry = await call.backends.update_knowledge_entry(call.acting, change, call.timeout_s)
    return _written(entry)


UPDATE_KNOWLEDGE = Tool(
    name="update_knowledge",
    description=(
        "Change a knowledge entry; fields left out stay as they are. A STALE_VERSION "
        "error means it changed since you read it: read it again and redo the change."
    ),
    schema=object_schema(
        {
            "entry_id": string(""),
            # The contract's version is an int64; the bound makes a larger number an
            # error result naming the field, not a failure in the encoding.
            "version": integer("The version you read.", 1, INT64_MAX),
            "title": string("", max_length=TITLE_CHARS),
            "body": string("Markdown.", max_length=BODY_CHARS),
            "status": string("", max_length=32),
            "item_ids": id_list("Replaces the linked items."),
        },
        "entry_id",
        "version",
        # An update that changes nothing is a mistake worth telling the model about.
        minProperties=3,
    ),
    permissions=(KNOWLEDGE_WRITE,),
    rpcs=("KnowledgeService.UpdateKnowledgeEntry",),
    run=_update_knowledge,
    is_write=True,
)

TOOLS = (SEARCH_KNOWLEDGE, GET_KNOWLEDGE, CREATE_KNOWLEDGE, UPDATE_KNOWLEDGE)
