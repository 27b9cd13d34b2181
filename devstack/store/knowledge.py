"""Knowledge entries: the organization's documents, decisions, notes and debt records.

Entries are organization-wide (docs/spec/turn-loop.md, "Search the organization's knowledge base"):
a human of another organization never sees them, and gets ``NOT_FOUND`` for their ids.
Every change increments ``version`` and keeps the new version in
``ds_knowledge_versions``; an update must name the version it read and is ``ABORTED``
(STALE_VERSION) otherwise (README.md). The check is a compare-and-set in the
``UPDATE``'s ``WHERE`` clause, so two concurrent updates of one version cannot both win.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from devstack.errors import Aborted, NotFound
from devstack.store import search
from devstack.store.records import KnowledgeHit, KnowledgeRecord
from devstack.store.schema import knowledge_entries, knowledge_supersessions, knowledge_versions

#: How many keyword candidates a knowledge search considers before the kind filter.
_SEARCH_CANDIDATES = 1000


def _not_found(entry_id: str) -> NotFound:
    return NotFound(
        "ENTRY_NOT_FOUND", f"knowledge entry {entry_id!r} not found", {"entry_id": entry_id}
    )


async def get_entry(session: AsyncSession, *, org_id: str, entry_id: str) -> KnowledgeRecord:
    """The current version of an entry of ``org_id``; ``NotFound`` (ENTRY_NOT_FOUND)."""
    records = await _entries(session, org_id=org_id, ids=[entry_id])
    if not records:
        raise _not_found(entry_id)
    return records[0]


async def entry_version(
    session: AsyncSession, *, org_id: str, entry_id: str, version: int
) -> KnowledgeRecord:
    """The entry as it was at ``version`` (for idempotent replays)."""
    current = await get_entry(session, org_id=org_id, entry_id=entry_id)
    row = (
        (
            await session.execute(
                sa.select(knowledge_versions).where(
                    knowledge_versions.c.entry_id == entry_id,
                    knowledge_versions.c.version == version,
                )
            )
        )
        .mappings()
        .first()
    )
    if row is None:
        raise _not_found(entry_id)
    return KnowledgeRecord(
        entry_id=current.entry_id,
        organization_id=current.organization_id,
        kind=current.kind,
        title=row["title"],
        body=row["body"],
        status=row["status"],
        supersedes_ids=current.supersedes_ids,
        superseded_by_ids=current.superseded_by_ids,
        project_ids=tuple(row["project_ids"]),
        item_ids=tuple(row["item_ids"]),
        author_id=current.author_id,
        recorded_by=row["recorded_by"],
        version=version,
        create_time=current.create_time,
        update_time=row["update_time"],
    )


async def _entries(
    session: AsyncSession, *, org_id: str, ids: Sequence[str]
) -> list[KnowledgeRecord]:
    if not ids:
        return []
    rows = (
        (
            await session.execute(
                sa.select(knowledge_entries).where(
                    knowledge_entries.c.org_id == org_id, knowledge_entries.c.entry_id.in_(ids)
                )
            )
        )
        .mappings()
        .all()
    )
    found = [row["entry_id"] for row in rows]
    supersedes: dict[str, list[str]] = defaultdict(list)
    superseded_by: dict[str, list[str]] = defaultdict(list)
    if found:
        links = (
            await session.execute(
                sa.select(knowledge_supersessions)
                .where(
                    sa.or_(
                        knowledge_supersessions.c.entry_id.in_(found),
                        knowledge_supersessions.c.supersedes_id.in_(found),
                    )
                )
                .order_by(
                    knowledge_supersessions.c.entry_id, knowledge_supersessions.c.supersedes_id
                )
            )
        ).all()
        for newer, older in links:
            supersedes[newer].append(older)
            superseded_by[older].append(newer)
    by_id = {
        row["entry_id"]: KnowledgeRecord(
            entry_id=row["entry_id"],
            organization_id=row["org_id"],
            kind=row["kind"],
            title=row["title"],
            body=row["body"],
            status=row["status"],
            supersedes_ids=tuple(supersedes[row["entry_id"]]),
            superseded_by_ids=tuple(superseded_by[row["entry_id"]]),
            project_ids=tuple(row["project_ids"]),
            item_ids=tuple(row["item_ids"]),
            author_id=row["author_id"],
            recorded_by=row["recorded_by"],
            version=row["version"],
            create_time=row["create_time"],
            update_time=row["update_time"],
        )
        for row in rows
    }
    return [by_id[entry_id] for entry_id in ids if entry_id in by_id]


async def create_entry(
    session: AsyncSession,
    *,
    org_id: str,
    kind: str,
    title: str,
    body: str,
    status: str,
    project_ids: Sequence[str],
    item_ids: Sequence[str],
    author_id: str,
    recorded_by: str,
    entry_id: str | None = None,
    source_id: str | None = None,
    create_time: float | None = None,
) -> KnowledgeRecord:
    """Store a new entry at version 1 and return it (ids default to ``ke-<random>``)."""
    entry_id = entry_id or f"ke-{uuid.uuid4().hex[:16]}"
    now = time.time()
    created = now if create_time is None else create_time
    await session.execute(
        sa.insert(knowledge_entries).values(
            entry_id=entry_id,
            org_id=org_id,
            kind=kind,
            title=title,
            body=body,
            status=status,
            project_ids=list(project_ids),
            item_ids=list(item_ids),
            author_id=author_id,
            recorded_by=recorded_by,
            version=1,
            create_time=created,
            update_time=created,
            source_id=source_id,
        )
    )
    await _keep_version(session, entry_id=entry_id, org_id=org_id)
    return await get_entry(session, org_id=org_id, entry_id=entry_id)


async def update_entry(
    session: AsyncSession,
    *,
    org_id: str,
    entry_id: str,
    expected_version: int,
    recorded_by: str,
    title: str | None = None,
    body: str | None = None,
    status: str | None = None,
    item_ids: Sequence[str] | None = None,
) -> KnowledgeRecord:
    """Change the fields given (None: unchanged) if the entry is still at ``expected_version``.

    Raises ``NotFound`` (ENTRY_NOT_FOUND) and ``Aborted`` (STALE_VERSION, with the current
    version in the ErrorInfo metadata).
    """
    current = await get_entry(session, org_id=org_id, entry_id=entry_id)
    values: dict[str, object] = {
        "version": current.version + 1,
        "recorded_by": recorded_by,
        "update_time": time.time(),
    }
    for name, value in (("title", title), ("body", body), ("status", status)):
        if value is not None:
            values[name] = value
    if item_ids is not None:
        values["item_ids"] = list(item_ids)
    result = await session.execute(
        sa.update(knowledge_entries)
        .where(
            knowledge_entries.c.entry_id == entry_id,
            knowledge_entries.c.version == expected_version,
        )
        .values(**values)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise Aborted(
            "STALE_VERSION",
            f"entry {entry_id!r} is at version {current.version}, not {expected_version}",
            {"entry_id": entry_id, "current_version": str(current.version)},
        )
    await _keep_version(session, entry_id=entry_id, org_id=org_id)
    return await get_entry(session, org_id=org_id, entry_id=entry_id)


async def _keep_version(session: AsyncSession, *, entry_id: str, org_id: str) -> None:
    row = (
        (
            await session.execute(
                sa.select(knowledge_entries).where(knowledge_entries.c.entry_id == entry_id)
            )
        )
        .mappings()
        .one()
    )
    await session.execute(
        sa.insert(knowledge_versions).values(
            entry_id=entry_id,
            version=row["version"],
            title=row["title"],
            body=row["body"],
            status=row["status"],
            project_ids=row["project_ids"],
            item_ids=row["item_ids"],
            recorded_by=row["recorded_by"],
            update_time=row["update_time"],
        )
    )
    await search.put_documents(
        session,
        [
            {
                "doc_type": "knowledge",
                "ref_id": entry_id,
                "org_id": org_id,
                "project_id": "",
                "title": row["title"],
                "body": row["body"],
            }
        ],
    )


async def entry_id_for_source(session: AsyncSession, source_id: str) -> tuple[str, int] | None:
    """``(entry_id, version)`` of the entry imported from ``source_id``, if any."""
    row = (
        await session.execute(
            sa.select(knowledge_entries.c.entry_id, knowledge_entries.c.version).where(
                knowledge_entries.c.source_id == source_id
            )
        )
    ).first()
    return None if row is None else (str(row[0]), int(row[1]))


async def set_supersedes(
    session: AsyncSession, entry_id: str, supersedes_ids: Sequence[str]
) -> None:
    """Replace the list of entries that ``entry_id`` supersedes."""
    await session.execute(
        sa.delete(knowledge_supersessions).where(knowledge_supersessions.c.entry_id == entry_id)
    )
    for older in dict.fromkeys(supersedes_ids):
        await session.execute(
            sa.insert(knowledge_supersessions).values(entry_id=entry_id, supersedes_id=older)
        )


async def search_entries(
    session: AsyncSession,
    dialect: str,
    *,
    org_id: str,
    query: str,
    kind: str,
    offset: int,
    limit: int,
) -> tuple[list[KnowledgeHit], bool]:
    """One page of the organization's entries matching ``query`` (best first; newest first
    when ``query`` is empty), of ``kind`` when set; and whether more follow.

    The score is the reciprocal rank ``1 / (60 + rank)`` (the keyword signal of project
    search alone; higher is better).
    """
    words = search.query_words(query)
    if words:
        ranked = [
            ref
            for _type, ref in await search.keyword_ranking(
                session,
                dialect,
                words,
                org_id=org_id,
                scopes=[("knowledge", [])],
                limit=_SEARCH_CANDIDATES,
            )
        ]
        if kind:
            rows = await session.execute(
                sa.select(knowledge_entries.c.entry_id, knowledge_entries.c.kind).where(
                    knowledge_entries.c.entry_id.in_(ranked)
                )
            )
            kinds = {str(entry_id): str(entry_kind) for entry_id, entry_kind in rows.all()}
            ranked = [ref for ref in ranked if kinds.get(ref) == kind]
    else:
        where = [knowledge_entries.c.org_id == org_id]
        if kind:
            where.append(knowledge_entries.c.kind == kind)
        ranked = list(
            (
                await session.scalars(
                    sa.select(knowledge_entries.c.entry_id)
                    .where(*where)
                    .order_by(knowledge_entries.c.create_time.desc(), knowledge_entries.c.entry_id)
                    .limit(offset + limit + 1)
                )
            ).all()
        )
    page = ranked[offset : offset + limit]
    records = await _entries(session, org_id=org_id, ids=page)
    hits = [
        KnowledgeHit(
            entry=record,
            score=1.0 / (search.RRF_K + offset + rank),
            snippet=search.snippet(record.body, words),
        )
        for rank, record in enumerate(records, start=1)
    ]
    return hits, len(ranked) > offset + limit
