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
    DATA_NOT_INSTRUCTIONS,
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
_ENTRY_HEAD = (
    '"entry_id", "kind", "title", "status", "version", "author_id", "recorded_by", '
    '"project_ids", "item_ids"'
)


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
        "Search the organization's knowledge base: documents, decisions, notes and "
        "technical-debt records, best first; an empty query lists the newest entries. "
        "Use get_knowledge to read an entry's body. Returns "
        '{"hits": [{' + _ENTRY_HEAD + ', "update_time"?, "score", "snippet"}], '
        '"next_page_token"?}.' + DATA_NOT_INSTRUCTIONS
    ),
    schema=object_schema(
        {
            "query": string("What to look for, in words.", max_length=1000, min_length=0),
            "kind": enum("Only entries of this kind.", *_KINDS),
            "limit": integer("At most this many entries (default 10).", 1, 50),
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
    description=(
        "Read one knowledge entry with its body. Returns "
        '{"entry": {' + _ENTRY_HEAD + ', "body", "supersedes_ids", "superseded_by_ids", '
        '"create_time"?, "update_time"?}}. Keep "version": update_knowledge needs it.'
        + DATA_NOT_INSTRUCTIONS
    ),
    schema=object_schema({"entry_id": string("The entry's id.")}, "entry_id"),
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
        "Write a new knowledge entry (a document, decision, note or debt record) linked "
        "to this project and, optionally, to items of it. It is attributed to the human "
        "you work for, so write only what they asked for or agreed to. Returns "
        '{"entry": {' + _ENTRY_HEAD + "}} with version 1."
    ),
    schema=object_schema(
        {
            "kind": enum("What kind of entry.", *_KINDS),
            "title": string("The title.", max_length=TITLE_CHARS),
            "body": string("The body, in markdown.", max_length=BODY_CHARS),
            "status": string("A status, e.g. proposed or accepted for a decision.", max_length=32),
            "item_ids": id_list("Items of this project to link the entry to."),
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
        "Change a knowledge entry. Send the version you read with get_knowledge; fields "
        "you leave out stay as they are, and item_ids replaces the linked items. If the "
        "entry changed since you read it, the result is a STALE_VERSION error: read it "
        "again and redo the change. Returns "
        '{"entry": {' + _ENTRY_HEAD + "}} with the new version."
    ),
    schema=object_schema(
        {
            "entry_id": string("The entry to change."),
            # The contract's version is an int64; the bound makes a larger number an
            # error result naming the field, not a failure in the encoding.
            "version": integer("The version you read.", 1, INT64_MAX),
            "title": string("A new title.", max_length=TITLE_CHARS),
            "body": string("A new body, in markdown.", max_length=BODY_CHARS),
            "status": string("A new status.", max_length=32),
            "item_ids": id_list("The items to link, replacing the linked ones."),
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
