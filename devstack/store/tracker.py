"""Tracker queries: items, dependencies, runnable tickets, project search and changesets.

Functions take the unit of work's ``AsyncSession``; the servicer opens it and checks
access first (``devstack.store.access``). Items are ordered by priority then id (the
``ListItemsResponse`` contract), pages continue after a ``(priority, item_id)`` keyset so
a walk never skips or repeats an item even when rows are added meanwhile.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from devstack.errors import NotFound
from devstack.store import search
from devstack.store.records import (
    ChangesetRecord,
    ItemPage,
    ItemRecord,
    Policy,
    SearchHit,
    SkillView,
)
from devstack.store.schema import changesets, dependencies, items

#: An item's position in priority-then-id order, for keyset pagination.
ItemKey = tuple[int, str]


def _keyset(after: ItemKey | None) -> list[sa.ColumnElement[bool]]:
    if after is None:
        return []
    priority, item_id = after
    return [
        sa.or_(
            items.c.priority > priority,
            sa.and_(items.c.priority == priority, items.c.item_id > item_id),
        )
    ]


async def _page(
    session: AsyncSession,
    project_id: str,
    conditions: list[sa.ColumnElement[bool]],
    after: ItemKey | None,
    limit: int,
) -> ItemPage:
    where = [items.c.project_id == project_id, *conditions]
    total = await session.scalar(sa.select(sa.func.count()).select_from(items).where(*where))
    rows = (
        (
            await session.execute(
                sa.select(items)
                .where(*where, *_keyset(after))
                .order_by(items.c.priority, items.c.item_id)
                .limit(limit + 1)
            )
        )
        .mappings()
        .all()
    )
    records = await _records(session, project_id, rows[:limit])
    return ItemPage(items=records, more=len(rows) > limit, total=int(total or 0))


async def _records(
    session: AsyncSession, project_id: str, rows: Sequence[sa.RowMapping]
) -> list[ItemRecord]:
    ids = [row["item_id"] for row in rows]
    blocked_by, blocks = await _dependencies(session, project_id, ids)
    return [_record(row, blocked_by[row["item_id"]], blocks[row["item_id"]]) for row in rows]


async def _dependencies(
    session: AsyncSession, project_id: str, ids: Sequence[str]
) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    blocked_by: dict[str, list[str]] = defaultdict(list)
    blocks: dict[str, list[str]] = defaultdict(list)
    if not ids:
        return blocked_by, blocks
    rows = (
        await session.execute(
            sa.select(dependencies.c.item_id, dependencies.c.blocked_by_id)
            .where(
                dependencies.c.project_id == project_id,
                sa.or_(dependencies.c.item_id.in_(ids), dependencies.c.blocked_by_id.in_(ids)),
            )
            .order_by(dependencies.c.item_id, dependencies.c.blocked_by_id)
        )
    ).all()
    wanted = set(ids)
    for item_id, blocked_by_id in rows:
        if item_id in wanted:
            blocked_by[item_id].append(blocked_by_id)
        if blocked_by_id in wanted:
            blocks[blocked_by_id].append(item_id)
    return blocked_by, blocks


def _record(row: sa.RowMapping, blocked_by: list[str], blocks: list[str]) -> ItemRecord:
    policy = row["policy"]
    return ItemRecord(
        project_id=row["project_id"],
        item_id=row["item_id"],
        kind=row["kind"],
        title=row["title"],
        description=row["description"],
        acceptance_criteria=row["acceptance_criteria"],
        state=row["state"],
        priority=row["priority"],
        ticket_type=row["ticket_type"],
        epic_id=row["epic_id"],
        milestone_id=row["milestone_id"],
        blocked_by_ids=tuple(blocked_by),
        blocks_ids=tuple(blocks),
        policy=None
        if policy is None
        else Policy(mode=str(policy.get("mode", "")), settings=dict(policy.get("settings", {}))),
        labels=tuple(row["labels"] or ()),
        create_time=row["create_time"],
        update_time=row["update_time"],
    )


async def list_items(
    session: AsyncSession,
    project_id: str,
    *,
    kind: str = "",
    state: str = "",
    epic_id: str = "",
    milestone_id: str = "",
    after: ItemKey | None = None,
    limit: int,
) -> ItemPage:
    """One page of the project's items matching every filter that is set (empty: any).

    ``epic_id`` and ``milestone_id`` must name an epic / milestone of the project, else
    ``NotFound`` (EPIC_NOT_FOUND / MILESTONE_NOT_FOUND): an unknown filter target is a
    mistake worth reporting, not an empty list.
    """
    for target, wanted, reason in (
        (epic_id, "epic", "EPIC_NOT_FOUND"),
        (milestone_id, "milestone", "MILESTONE_NOT_FOUND"),
    ):
        if target and (await item_kinds(session, project_id, [target])).get(target) != wanted:
            raise NotFound(
                reason,
                f"{wanted} {target!r} not found in project {project_id!r}",
                {"item_id": target, "project_id": project_id},
            )
    conditions: list[sa.ColumnElement[bool]] = []
    if kind:
        conditions.append(items.c.kind == kind)
    if state:
        conditions.append(items.c.state == state)
    if epic_id:
        conditions.append(items.c.epic_id == epic_id)
    if milestone_id:
        conditions.append(items.c.milestone_id == milestone_id)
    return await _page(session, project_id, conditions, after, limit)


async def runnable_tickets(
    session: AsyncSession, project_id: str, *, after: ItemKey | None = None, limit: int
) -> ItemPage:
    """One page of runnable tickets: open tickets none of whose blockers is still open.

    A blocker is any item of the project (ticket, epic or milestone) that blocks the
    ticket; it is resolved when its state is ``closed`` (seed: list_runnable, "Ready
    tickets whose blockers are resolved").
    """
    blocker = items.alias("blocker")
    open_blocker = (
        sa.select(dependencies.c.item_id)
        .join(
            blocker,
            sa.and_(
                blocker.c.project_id == dependencies.c.project_id,
                blocker.c.item_id == dependencies.c.blocked_by_id,
            ),
        )
        .where(
            dependencies.c.project_id == project_id,
            dependencies.c.item_id == items.c.item_id,
            blocker.c.state != "closed",
        )
        .exists()
    )
    conditions = [items.c.kind == "ticket", items.c.state == "open", ~open_blocker]
    return await _page(session, project_id, conditions, after, limit)


async def get_item(session: AsyncSession, project_id: str, item_id: str) -> ItemRecord:
    """One item of the project; ``NotFound`` (ITEM_NOT_FOUND) when it is not there."""
    row = (
        (
            await session.execute(
                sa.select(items).where(items.c.project_id == project_id, items.c.item_id == item_id)
            )
        )
        .mappings()
        .first()
    )
    if row is None:
        raise NotFound(
            "ITEM_NOT_FOUND",
            f"item {item_id!r} not found in project {project_id!r}",
            {"item_id": item_id, "project_id": project_id},
        )
    return (await _records(session, project_id, [row]))[0]


async def get_items(session: AsyncSession, project_id: str, ids: Sequence[str]) -> list[ItemRecord]:
    """The items of ``ids`` that exist in the project, in the order of ``ids``."""
    if not ids:
        return []
    rows = (
        (
            await session.execute(
                sa.select(items).where(items.c.project_id == project_id, items.c.item_id.in_(ids))
            )
        )
        .mappings()
        .all()
    )
    by_id = {record.item_id: record for record in await _records(session, project_id, rows)}
    return [by_id[item_id] for item_id in ids if item_id in by_id]


async def item_kinds(session: AsyncSession, project_id: str, ids: Iterable[str]) -> dict[str, str]:
    """The kind of each id of ``ids`` that exists in the project."""
    wanted = sorted(set(ids))
    if not wanted:
        return {}
    rows = await session.execute(
        sa.select(items.c.item_id, items.c.kind).where(
            items.c.project_id == project_id, items.c.item_id.in_(wanted)
        )
    )
    return {str(item_id): str(kind) for item_id, kind in rows.all()}


async def search_project(
    session: AsyncSession,
    dialect: str,
    *,
    org_id: str,
    project_id: str,
    query: str,
    skills: Sequence[SkillView] | None,
    include_items: bool,
    offset: int,
    limit: int,
) -> tuple[list[SearchHit], bool]:
    """One page of hybrid search hits over items and/or the project's effective skills.

    ``skills`` is the project's effective skills (None: skills are not searched). Returns
    the hits (best first, from ``offset``) and whether more follow. Three rankings are
    fused (docs/decisions/0103): keyword, title trigrams, and an exact item id in the query.
    """
    words = search.query_words(query)
    scopes: list[tuple[str, Sequence[str]]] = []
    if include_items:
        scopes.append(("item", [project_id]))
    skill_refs: dict[str, SkillView] = {}
    if skills is not None:
        skill_refs = {f"{skill.skill_id}@{skill.version}": skill for skill in skills}
        scopes.append(("skill", sorted({"", project_id})))
    keyword = [
        (doc_type, ref)
        for doc_type, ref in await search.keyword_ranking(
            session, dialect, words, org_id=org_id, scopes=scopes
        )
        # A skill document of a version the project does not resolve is not a hit.
        if doc_type == "item" or ref in skill_refs
    ]
    keyword = [
        ("item", ref.split("/", 1)[1]) if doc_type == "item" else (doc_type, ref)
        for doc_type, ref in keyword
    ]
    candidates: list[tuple[tuple[str, str], str]] = []
    exact: list[tuple[str, str]] = []
    if include_items:
        rows = await session.execute(
            sa.select(items.c.item_id, items.c.title).where(items.c.project_id == project_id)
        )
        titles = {str(item_id): str(title) for item_id, title in rows.all()}
        candidates.extend((("item", item_id), title) for item_id, title in titles.items())
        for token in query.split():
            token = token.strip(".,;:!?()[]{}\"'`")
            if token in titles and ("item", token) not in exact:
                exact.append(("item", token))
    candidates.extend(
        (("skill", ref), f"{skill.name.replace('-', ' ')} {skill.description}")
        for ref, skill in skill_refs.items()
    )
    fused = search.fuse([exact, keyword, search.trigram_ranking(query, candidates)])
    page = fused[offset : offset + limit]
    records = {
        record.item_id: record
        for record in await get_items(
            session, project_id, [ref for (doc_type, ref), _ in page if doc_type == "item"]
        )
    }
    hits: list[SearchHit] = []
    for (doc_type, ref), score in page:
        if doc_type == "item" and ref in records:
            record = records[ref]
            text = record.description or record.title
            hits.append(SearchHit(score=score, snippet=search.snippet(text, words), item=record))
        elif doc_type == "skill":
            skill = skill_refs[ref]
            hits.append(
                SearchHit(
                    score=score, snippet=search.snippet(skill.description, words), skill=skill
                )
            )
    return hits, len(fused) > offset + limit


async def list_changesets(
    session: AsyncSession, project_id: str, *, status: str, before_seq: int | None, limit: int
) -> tuple[list[ChangesetRecord], bool]:
    """One page of the project's changesets, newest first; and whether more follow."""
    where = [changesets.c.project_id == project_id]
    if status:
        where.append(changesets.c.status == status)
    if before_seq is not None:
        where.append(changesets.c.seq < before_seq)
    rows = (
        (
            await session.execute(
                sa.select(changesets)
                .where(*where)
                .order_by(changesets.c.seq.desc())
                .limit(limit + 1)
            )
        )
        .mappings()
        .all()
    )
    return [_changeset(row) for row in rows[:limit]], len(rows) > limit


async def get_changeset(session: AsyncSession, changeset_id: str) -> ChangesetRecord:
    """One changeset by id; ``NotFound`` (CHANGESET_NOT_FOUND) when there is none."""
    row = (
        (
            await session.execute(
                sa.select(changesets).where(changesets.c.changeset_id == changeset_id)
            )
        )
        .mappings()
        .first()
    )
    if row is None:
        raise NotFound("CHANGESET_NOT_FOUND", f"changeset {changeset_id!r} not found")
    return _changeset(row)


async def insert_changeset(
    session: AsyncSession,
    *,
    project_id: str,
    title: str,
    description: str,
    operations: list[dict[str, Any]],
    author_id: str,
    recorded_by: str,
) -> ChangesetRecord:
    """Store a new changeset with status ``proposed`` and return it."""
    changeset_id = f"cs-{uuid.uuid4().hex[:16]}"
    await session.execute(
        sa.insert(changesets).values(
            changeset_id=changeset_id,
            project_id=project_id,
            status="proposed",
            title=title,
            description=description,
            operations=operations,
            author_id=author_id,
            recorded_by=recorded_by,
            create_time=time.time(),
        )
    )
    return await get_changeset(session, changeset_id)


def _changeset(row: sa.RowMapping) -> ChangesetRecord:
    return ChangesetRecord(
        changeset_id=row["changeset_id"],
        project_id=row["project_id"],
        status=row["status"],
        title=row["title"],
        description=row["description"],
        operations=list(row["operations"]),
        author_id=row["author_id"],
        recorded_by=row["recorded_by"],
        create_time=row["create_time"],
        seq=row["seq"],
    )
