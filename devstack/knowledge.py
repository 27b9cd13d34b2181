"""The devstack's ``ballet.knowledge.v1.KnowledgeService``: the organization's knowledge base.

Knowledge is organization-wide (docs/spec/turn-loop.md): the token's organization scopes every call,
and ``knowledge.read`` / ``knowledge.write`` are the union of the human's role
permissions over that organization's projects (docs/decisions/0101). Writes are
idempotent on ``request_id`` (AIP-155) and attributed to the human (``author_id``) while
``recorded_by`` names the honoured actor, e.g. ``planner:<session_id>`` (docs/spec/authority.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from ballet.knowledge.v1 import knowledge_pb2, knowledge_pb2_grpc
from sqlalchemy.ext.asyncio import AsyncSession

from devstack.auth import KNOWLEDGE_READ, KNOWLEDGE_WRITE, Caller
from devstack.errors import InvalidArgument, NotFound
from devstack.pages import PageTokens, page_size
from devstack.rpc import Backend
from devstack.store import Store
from devstack.store import knowledge as knowledge_store
from devstack.store import tracker as items_store
from devstack.store.access import organization_permissions, project_access, require
from devstack.store.idempotency import check_request_id, digest, remember, replay_ref
from devstack.store.records import KnowledgeRecord
from devstack.tracker import timestamp

SERVICE = "ballet.knowledge.v1.KnowledgeService"
DOMAIN = "knowledge.ballet"
SEARCH_DEFAULT, SEARCH_MAX = 10, 50

KIND_NAMES = {
    knowledge_pb2.KNOWLEDGE_KIND_DOCUMENT: "document",
    knowledge_pb2.KNOWLEDGE_KIND_DECISION: "decision",
    knowledge_pb2.KNOWLEDGE_KIND_NOTE: "note",
    knowledge_pb2.KNOWLEDGE_KIND_DEBT: "debt",
}
_KINDS = {name: value for value, name in KIND_NAMES.items()}


def entry_message(
    entry: KnowledgeRecord, *, with_body: bool = True
) -> knowledge_pb2.KnowledgeEntry:
    """The proto of an entry (search hits leave the body out, as the contract says)."""
    return knowledge_pb2.KnowledgeEntry(
        entry_id=entry.entry_id,
        organization_id=entry.organization_id,
        kind=_KINDS[entry.kind],
        title=entry.title,
        body=entry.body if with_body else "",
        status=entry.status,
        supersedes_ids=entry.supersedes_ids,
        superseded_by_ids=entry.superseded_by_ids,
        project_ids=entry.project_ids,
        item_ids=entry.item_ids,
        author_id=entry.author_id,
        recorded_by=entry.recorded_by,
        version=entry.version,
        create_time=timestamp(entry.create_time),
        update_time=timestamp(entry.update_time),
    )


def _kind(value: int, *, required: bool) -> str:
    if value == 0:
        if required:
            raise InvalidArgument("KIND_REQUIRED", "kind is required")
        return ""
    name = KIND_NAMES.get(knowledge_pb2.KnowledgeKind.ValueType(value))
    if name is None:
        raise InvalidArgument("INVALID_ENUM_VALUE", f"kind has an unknown value {value}")
    return name


async def _org_permission(session: AsyncSession, caller: Caller, permission: str) -> None:
    granted = await organization_permissions(
        session, human=caller.human, organization_id=caller.organization_id
    )
    require(granted, permission, where=f"organization {caller.organization_id}")


async def _check_items(
    session: AsyncSession, caller: Caller, project_id: str, item_ids: Sequence[str]
) -> None:
    """The project must be visible to the human and hold every item (NOT_FOUND otherwise)."""
    await project_access(
        session, human=caller.human, organization_id=caller.organization_id, project_id=project_id
    )
    found = await items_store.item_kinds(session, project_id, item_ids)
    for item_id in item_ids:
        if item_id not in found:
            raise NotFound(
                "ITEM_NOT_FOUND",
                f"item {item_id!r} not found in project {project_id!r}",
                {"item_id": item_id, "project_id": project_id},
            )


class KnowledgeServicer(knowledge_pb2_grpc.KnowledgeServiceServicer):
    """The knowledge backend over the devstack store."""

    def __init__(self, store: Store, backend: Backend, pages: PageTokens) -> None:
        self._store = store
        self._rpc = backend
        self._pages = pages

    async def SearchKnowledge(
        self,
        request: knowledge_pb2.SearchKnowledgeRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> knowledge_pb2.SearchKnowledgeResponse:
        """Keyword search (FTS5 bm25 / ts_rank) over the organization's entries, or newest
        first for an empty query; needs knowledge.read. Hits leave out the body."""

        async def work(caller: Caller) -> knowledge_pb2.SearchKnowledgeResponse:
            size = page_size(request.page_size, default=SEARCH_DEFAULT, maximum=SEARCH_MAX)
            kind = _kind(request.kind, required=False)
            filters = {"org": caller.organization_id, "query": request.query, "kind": kind}
            position = self._pages.decode_page(request.page_token, "SearchKnowledge", filters)
            offset = int(position["o"]) if position else 0
            async with self._store.read() as session:
                await _org_permission(session, caller, KNOWLEDGE_READ)
                hits, more = await knowledge_store.search_entries(
                    session,
                    self._store.dialect,
                    org_id=caller.organization_id,
                    query=request.query,
                    kind=kind,
                    offset=offset,
                    limit=size,
                )
            token = (
                self._pages.encode("SearchKnowledge", filters, {"o": offset + size}) if more else ""
            )
            return knowledge_pb2.SearchKnowledgeResponse(
                hits=[
                    knowledge_pb2.KnowledgeHit(
                        entry=entry_message(hit.entry, with_body=False),
                        score=hit.score,
                        snippet=hit.snippet,
                    )
                    for hit in hits
                ],
                next_page_token=token,
            )

        return await self._rpc.run(context, "SearchKnowledge", work)

    async def GetKnowledgeEntry(
        self,
        request: knowledge_pb2.GetKnowledgeEntryRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> knowledge_pb2.GetKnowledgeEntryResponse:
        """One entry of the caller's organization; needs knowledge.read; NOT_FOUND
        (ENTRY_NOT_FOUND) for an unknown id or another organization's entry."""

        async def work(caller: Caller) -> knowledge_pb2.GetKnowledgeEntryResponse:
            async with self._store.read() as session:
                await _org_permission(session, caller, KNOWLEDGE_READ)
                entry = await knowledge_store.get_entry(
                    session, org_id=caller.organization_id, entry_id=request.entry_id
                )
            return knowledge_pb2.GetKnowledgeEntryResponse(entry=entry_message(entry))

        return await self._rpc.run(context, "GetKnowledgeEntry", work)

    async def CreateKnowledgeEntry(
        self,
        request: knowledge_pb2.CreateKnowledgeEntryRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> knowledge_pb2.CreateKnowledgeEntryResponse:
        """Create an entry at version 1; needs knowledge.write; idempotent on request_id.

        ``project_id`` must be a project the human can see and ``item_ids`` items of it
        (NOT_FOUND); items without a project are INVALID_ARGUMENT. A repeated request_id
        with the same payload returns the first entry as created; with another payload
        INVALID_ARGUMENT/REQUEST_ID_REUSED.
        """

        async def work(caller: Caller) -> knowledge_pb2.CreateKnowledgeEntryResponse:
            check_request_id(request.request_id)
            kind = _kind(request.kind, required=True)
            if not request.title.strip():
                raise InvalidArgument("TITLE_REQUIRED", "title is required")
            if request.item_ids and not request.project_id:
                raise InvalidArgument(
                    "PROJECT_REQUIRED", "item_ids need the project_id they belong to"
                )
            payload_hash = _payload_hash(request)
            written = False

            async def unit(session: AsyncSession) -> KnowledgeRecord:
                nonlocal written
                await _org_permission(session, caller, KNOWLEDGE_WRITE)
                key = {"method": "CreateKnowledgeEntry", "human": caller.human}
                ref = await replay_ref(
                    session, **key, request_id=request.request_id, payload_hash=payload_hash
                )
                if ref is not None:
                    return await _replayed(session, caller, ref)
                if request.project_id:
                    await _check_items(session, caller, request.project_id, request.item_ids)
                entry = await knowledge_store.create_entry(
                    session,
                    org_id=caller.organization_id,
                    kind=kind,
                    title=request.title,
                    body=request.body,
                    status=request.status,
                    project_ids=[request.project_id] if request.project_id else [],
                    item_ids=list(dict.fromkeys(request.item_ids)),
                    author_id=caller.human,
                    recorded_by=caller.recorded_by,
                )
                await remember(
                    session,
                    **key,
                    request_id=request.request_id,
                    payload_hash=payload_hash,
                    result_ref=f"{entry.entry_id}@{entry.version}",
                )
                written = True
                return entry

            entry = await self._store.run_write(unit)
            if written:
                self._rpc.note_write(request.request_id)
            return knowledge_pb2.CreateKnowledgeEntryResponse(entry=entry_message(entry))

        return await self._rpc.run(
            context,
            "CreateKnowledgeEntry",
            work,
            project_id=request.project_id,
            request_id=request.request_id,
        )

    async def UpdateKnowledgeEntry(
        self,
        request: knowledge_pb2.UpdateKnowledgeEntryRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> knowledge_pb2.UpdateKnowledgeEntryResponse:
        """Change an entry; needs knowledge.write; the version read must be sent.

        ABORTED (STALE_VERSION) when the entry moved on; NOT_FOUND for an unknown entry;
        INVALID_ARGUMENT for version <= 0, or replacing items of an entry not linked to
        exactly one project. Idempotent on request_id: a repeat returns the entry as the
        first request left it (checked before the version, which has moved on since).
        """

        async def work(caller: Caller) -> knowledge_pb2.UpdateKnowledgeEntryResponse:
            check_request_id(request.request_id)
            if request.version <= 0:
                raise InvalidArgument("VERSION_REQUIRED", "send the version you read (>= 1)")
            if request.item_ids and not request.replace_item_ids:
                raise InvalidArgument(
                    "REPLACE_ITEM_IDS_REQUIRED", "set replace_item_ids to change the linked items"
                )
            if request.HasField("title") and not request.title.strip():
                raise InvalidArgument("TITLE_REQUIRED", "title cannot be empty")
            payload_hash = _payload_hash(request)
            written = False

            async def unit(session: AsyncSession) -> KnowledgeRecord:
                nonlocal written
                await _org_permission(session, caller, KNOWLEDGE_WRITE)
                key = {"method": "UpdateKnowledgeEntry", "human": caller.human}
                ref = await replay_ref(
                    session, **key, request_id=request.request_id, payload_hash=payload_hash
                )
                if ref is not None:
                    return await _replayed(session, caller, ref)
                current = await knowledge_store.get_entry(
                    session, org_id=caller.organization_id, entry_id=request.entry_id
                )
                item_ids: list[str] | None = None
                if request.replace_item_ids:
                    item_ids = list(dict.fromkeys(request.item_ids))
                    if item_ids:
                        if len(current.project_ids) != 1:
                            raise InvalidArgument(
                                "ENTRY_PROJECT_AMBIGUOUS",
                                "items can be linked only to an entry of exactly one project",
                                {"entry_id": current.entry_id},
                            )
                        await _check_items(session, caller, current.project_ids[0], item_ids)
                entry = await knowledge_store.update_entry(
                    session,
                    org_id=caller.organization_id,
                    entry_id=request.entry_id,
                    expected_version=request.version,
                    recorded_by=caller.recorded_by,
                    title=request.title if request.HasField("title") else None,
                    body=request.body if request.HasField("body") else None,
                    status=request.status if request.HasField("status") else None,
                    item_ids=item_ids,
                )
                await remember(
                    session,
                    **key,
                    request_id=request.request_id,
                    payload_hash=payload_hash,
                    result_ref=f"{entry.entry_id}@{entry.version}",
                )
                written = True
                return entry

            entry = await self._store.run_write(unit)
            if written:
                self._rpc.note_write(request.request_id)
            return knowledge_pb2.UpdateKnowledgeEntryResponse(entry=entry_message(entry))

        return await self._rpc.run(
            context, "UpdateKnowledgeEntry", work, request_id=request.request_id
        )


def _payload_hash(
    request: knowledge_pb2.CreateKnowledgeEntryRequest | knowledge_pb2.UpdateKnowledgeEntryRequest,
) -> str:
    # The request without its id: what must match for a repeat to be "the same request".
    payload = request.__deepcopy__()
    payload.request_id = ""
    return digest(payload.SerializeToString(deterministic=True))


async def _replayed(session: AsyncSession, caller: Caller, ref: str) -> KnowledgeRecord:
    entry_id, _, version = ref.rpartition("@")
    return await knowledge_store.entry_version(
        session, org_id=caller.organization_id, entry_id=entry_id, version=int(version)
    )
