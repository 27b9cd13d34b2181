"""Import a beads ``issues.jsonl`` export as a tracker project (README.md).

The mapping (docs/decisions/0102-devstack-beads-import.md):

- Kept rows: ``issue_type`` epic (-> epic) and task, bug, feature, chore (-> tickets with
  that ``ticket_type``). Dropped: the internal rows the data README names (``issue_type``
  event/molecule/agent/gate, ``status`` tombstone, ``ephemeral: true``, ids starting
  ``bd-wisp``) and rows that are not plan items (merge-request, message, role, rig, ...).
- States: open -> open; in_progress and hooked (work on an agent's hook) -> in_progress;
  blocked and deferred -> blocked; closed -> closed; pinned and anything unknown -> open.
  Lossy ones keep the beads status as a label ``beads-status:<status>``.
  Priorities are beads' own 0 (highest) to 4 scale, clamped; missing -> 2.
- ``parent-child`` dependencies sit on the child and point at the parent. A child's first
  parent that is an epic becomes its ``epic_id``; any other kept parent (a second epic, or
  a task or feature acting as parent) becomes a label ``parent:<id>``, so no link is lost.
- ``blocks`` dependencies: the row is blocked by ``depends_on_id``. Links to dropped rows,
  and other link types (discovered-from, related, ...), are not imported.
- Milestones: the export has none, so one is derived per version number in an epic title
  ("Version Bump: 0.30.7" -> milestone ``milestone-v0.30.7`` titled ``v0.30.7``); the epic
  and its tickets aim at it. It is closed when all its epics are.
- Acceptance criteria: the export's ``acceptance_criteria`` field when present, else the
  description's "Acceptance Criteria" section (moved out of the description).
  ``notes`` are appended to the description under "## Notes".

Rows are upserted by (project, beads id), so importing twice changes nothing.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from devstack.importers.errors import ImportFileError, decode, unreadable
from devstack.store import Store
from devstack.store.access import put_project
from devstack.store.db import upsert
from devstack.store.schema import dependencies, items
from devstack.store.search import put_documents

SOURCE = "beads"
#: This import's name in errors (the ``--tracker`` file).
IMPORTER = "tracker"
INTERNAL_TYPES = frozenset({"event", "molecule", "agent", "gate"})
TICKET_TYPES = frozenset({"task", "bug", "feature", "chore"})
#: beads status -> item state.
STATES = {
    "open": "open",
    "in_progress": "in_progress",
    "hooked": "in_progress",
    "blocked": "blocked",
    "deferred": "blocked",
    "closed": "closed",
    "pinned": "open",
}
#: Statuses whose state loses information; the beads status is kept as a label.
_LOSSY = frozenset({"hooked", "deferred", "pinned"})
DEFAULT_PRIORITY = 2

_VERSION = re.compile(r"(?<![\w.])v?(\d+\.\d+(?:\.\d+)?)(?![\w.%])")
# "## Acceptance Criteria", "**Acceptance Criteria:**", "### Acceptance:" on a line alone.
_ACCEPTANCE = re.compile(
    r"^(?:#{1,6}[ \t]*|\*\*[ \t]*)acceptance(?:[ \t]+criteria)?"
    r"[ \t]*:?[ \t]*(?:\*\*)?[ \t]*:?[ \t]*$",
    re.IGNORECASE | re.MULTILINE,
)
_NEXT_HEADING = re.compile(r"^(?:#{1,6}[ \t]+\S|\*\*[^*\n]+\*\*:?[ \t]*$)", re.MULTILINE)


def internal_reason(row: dict[str, Any]) -> str | None:
    """Why a row is an internal beads row to drop (data README), or None to keep it."""
    if row.get("issue_type") in INTERNAL_TYPES:
        return f"issue_type {row.get('issue_type')}"
    if row.get("status") == "tombstone":
        return "status tombstone"
    if row.get("ephemeral") is True:
        return "ephemeral"
    if str(row.get("id", "")).startswith("bd-wisp"):
        return "wisp id"
    return None


def split_acceptance(description: str) -> tuple[str, str]:
    """``(description without it, acceptance criteria)`` from an "Acceptance" section."""
    heading = _ACCEPTANCE.search(description)
    if heading is None:
        return description, ""
    following = _NEXT_HEADING.search(description, heading.end())
    end = following.start() if following else len(description)
    criteria = description[heading.end() : end].strip()
    rest = (description[: heading.start()].rstrip() + "\n\n" + description[end:].lstrip()).strip()
    return rest, criteria


def _seconds(value: Any, default: float) -> float:
    if not isinstance(value, str) or not value:
        return default
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return default


def _row(path: Path, number: int, raw: bytes) -> list[dict[str, Any]]:
    """Line ``number`` of the export as a row (none for a blank line)."""
    line = decode(IMPORTER, path, raw, number)
    if not line.strip():
        return []
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        problem = f"not valid JSON ({error.msg[:1].lower()}{error.msg[1:]}, column {error.colno})"
        raise ImportFileError(IMPORTER, path, problem, number) from None
    if not isinstance(row, dict) or not isinstance(row.get("id"), str):
        raise ImportFileError(IMPORTER, path, "not a beads issue (an object with an id)", number)
    problem = _shape_problem(row)
    if problem:
        raise ImportFileError(IMPORTER, path, f"issue {row['id'][:80]!r}: {problem}", number)
    return [row]


def _shape_problem(row: dict[str, Any]) -> str:
    """What is wrong with the types of the fields the mapping reads, or ""."""
    for name in ("issue_type", "status"):
        if name in row and row[name] is not None and not isinstance(row[name], str):
            return f"{name} is not a string"
    for name in ("labels", "dependencies"):
        if row.get(name) is not None and not isinstance(row[name], list):
            return f"{name} is not a list"
    for link in row.get("dependencies") or []:
        if not isinstance(link, dict):
            return "a dependency is not an object"
        for name in ("type", "depends_on_id"):
            if link.get(name) is not None and not isinstance(link[name], str):
                return f"a dependency's {name} is not a string"
    return ""


def _priority(value: Any) -> int:
    return min(4, max(0, value)) if isinstance(value, int) else DEFAULT_PRIORITY


@dataclass
class BeadsExport:
    """A parsed export: item rows for ``ds_items``, dependencies and what was dropped."""

    items: list[dict[str, Any]] = field(default_factory=list)
    blocks: list[tuple[str, str]] = field(default_factory=list)
    dropped: Counter[str] = field(default_factory=Counter)
    dropped_links: Counter[str] = field(default_factory=Counter)
    epic_links: int = 0
    parent_labels: int = 0


def parse_export(path: Path, project_id: str) -> BeadsExport:
    """Read ``issues.jsonl`` and map it (module docstring); touches no database.

    Raises ``ImportFileError`` naming the file and line of a row that is not UTF-8, not
    JSON, not a beads issue (an object with a string ``id``) or has a field of the wrong
    type, and naming the file when it cannot be read.
    """
    rows: list[dict[str, Any]] = []
    try:
        with path.open("rb") as handle:
            for number, raw in enumerate(handle, start=1):
                rows.extend(_row(path, number, raw))
    except OSError as error:
        raise unreadable(IMPORTER, path, error) from None
    export = BeadsExport()
    kept: dict[str, dict[str, Any]] = {}
    for row in rows:
        reason = internal_reason(row)
        kind = row.get("issue_type")
        if reason is None and kind != "epic" and kind not in TICKET_TYPES:
            reason = f"not a plan item ({kind})"
        if reason is not None:
            export.dropped[reason] += 1
            continue
        kept[row["id"]] = row
    now = time.time()
    by_id: dict[str, dict[str, Any]] = {}
    for item_id, row in kept.items():
        kind = "epic" if row["issue_type"] == "epic" else "ticket"
        status = str(row.get("status", "open"))
        labels = [str(label) for label in row.get("labels") or []]
        if status not in STATES or status in _LOSSY:
            labels.append(f"beads-status:{status}")
        description = str(row.get("description") or "")
        acceptance = str(row.get("acceptance_criteria") or "")
        if not acceptance:
            description, acceptance = split_acceptance(description)
        if row.get("notes"):
            description = f"{description}\n\n## Notes\n\n{row['notes']}".strip()
        created = _seconds(row.get("created_at"), now)
        by_id[item_id] = {
            "project_id": project_id,
            "item_id": item_id,
            "kind": kind,
            "title": str(row.get("title") or ""),
            "description": description,
            "acceptance_criteria": acceptance,
            "state": STATES.get(status, "open"),
            "priority": _priority(row.get("priority")),
            "ticket_type": "" if kind == "epic" else row["issue_type"],
            "epic_id": "",
            "milestone_id": "",
            "policy": None,
            "labels": labels,
            "source": SOURCE,
            "create_time": created,
            "update_time": _seconds(row.get("updated_at"), created),
        }
    for item_id, row in kept.items():
        item = by_id[item_id]
        for link in row.get("dependencies") or []:
            kind, target = link.get("type"), link.get("depends_on_id")
            if kind not in ("blocks", "parent-child"):
                export.dropped_links[str(kind)] += 1
                continue
            if target not in kept or target == item_id:
                export.dropped_links[f"{kind} to a dropped row"] += 1
                continue
            if kind == "blocks":
                export.blocks.append((item_id, target))
            elif by_id[target]["kind"] == "epic" and not item["epic_id"]:
                item["epic_id"] = target
                export.epic_links += 1
            else:
                item["labels"].append(f"parent:{target}")
                export.parent_labels += 1
    export.blocks = sorted(set(export.blocks))
    export.items = list(by_id.values()) + _milestones(by_id, project_id)
    return export


def _milestones(by_id: dict[str, dict[str, Any]], project_id: str) -> list[dict[str, Any]]:
    """Milestones derived from version numbers in epic titles (the export has none)."""
    epics_by_version: dict[str, list[dict[str, Any]]] = {}
    for item in by_id.values():
        if item["kind"] != "epic":
            continue
        match = _VERSION.search(item["title"])
        if match:
            epics_by_version.setdefault(f"v{match.group(1)}", []).append(item)
    milestones = []
    for version, epics in sorted(epics_by_version.items()):
        milestone_id = f"milestone-{version}"
        for epic in epics:
            epic["milestone_id"] = milestone_id
        for item in by_id.values():
            if item["kind"] == "ticket" and any(item["epic_id"] == e["item_id"] for e in epics):
                item["milestone_id"] = milestone_id
        names = ", ".join(sorted(epic["item_id"] for epic in epics))
        milestones.append(
            {
                "project_id": project_id,
                "item_id": milestone_id,
                "kind": "milestone",
                "title": version,
                "description": f"Derived from the version number in the titles of: {names}.",
                "acceptance_criteria": "",
                "state": "closed" if all(e["state"] == "closed" for e in epics) else "open",
                "priority": min(epic["priority"] for epic in epics),
                "ticket_type": "",
                "epic_id": "",
                "milestone_id": "",
                "policy": None,
                "labels": ["derived-milestone"],
                "source": SOURCE,
                "create_time": min(epic["create_time"] for epic in epics),
                "update_time": max(epic["update_time"] for epic in epics),
            }
        )
    return milestones


@dataclass(frozen=True)
class BeadsReport:
    """What an import did: counts by kind and ticket type, links, drops, seconds taken."""

    project_id: str
    items: int
    by_kind: dict[str, int]
    by_ticket_type: dict[str, int]
    blocks: int
    epic_links: int
    parent_labels: int
    dropped: dict[str, int]
    dropped_links: dict[str, int]
    seconds: float


async def import_beads(
    store: Store, path: Path, *, project_id: str, org_id: str = "acme"
) -> BeadsReport:
    """Import ``path`` into ``project_id`` of ``org_id`` in one transaction (an upsert).

    The project is created (or its settings replaced) with ``planner.model_credential =
    <project_id>-credential``, and the organization's users get their default roles.
    """
    started = time.perf_counter()
    export = await asyncio.to_thread(parse_export, path, project_id)

    async def unit(session: AsyncSession) -> None:
        await put_project(
            session,
            project_id=project_id,
            org_id=org_id,
            name=project_id,
            description=f"Imported from the beads export {path.name}.",
            settings={"planner.model_credential": f"{project_id}-credential"},
        )
        await upsert_items(session, export.items, org_id=org_id)
        imported = sa.select(items.c.item_id).where(
            items.c.project_id == project_id, items.c.source == SOURCE
        )
        await session.execute(
            sa.delete(dependencies).where(
                dependencies.c.project_id == project_id, dependencies.c.item_id.in_(imported)
            )
        )
        if export.blocks:
            await session.execute(
                sa.insert(dependencies),
                [
                    {"project_id": project_id, "item_id": item_id, "blocked_by_id": blocker}
                    for item_id, blocker in export.blocks
                ],
            )

    await store.run_write(unit)
    kinds = Counter(item["kind"] for item in export.items)
    types = Counter(item["ticket_type"] for item in export.items if item["kind"] == "ticket")
    return BeadsReport(
        project_id=project_id,
        items=len(export.items),
        by_kind=dict(kinds),
        by_ticket_type=dict(types),
        blocks=len(export.blocks),
        epic_links=export.epic_links,
        parent_labels=export.parent_labels,
        dropped=dict(export.dropped),
        dropped_links=dict(export.dropped_links),
        seconds=time.perf_counter() - started,
    )


async def upsert_items(session: AsyncSession, rows: list[dict[str, Any]], *, org_id: str) -> None:
    """Insert or update item rows (keyed by project and id) and their search documents."""
    if not rows:
        return
    insert = upsert(session, items)
    changed = {
        column.name: insert.excluded[column.name]
        for column in items.columns
        if column.name not in ("project_id", "item_id")
    }
    await session.execute(
        insert.on_conflict_do_update(index_elements=["project_id", "item_id"], set_=changed), rows
    )
    await put_documents(session, [search_document(row, org_id) for row in rows])


def search_document(row: dict[str, Any], org_id: str) -> dict[str, str]:
    """The search document of an item row: title, then description, criteria and labels."""
    body = "\n\n".join(
        part
        for part in (row["description"], row["acceptance_criteria"], " ".join(row["labels"]))
        if part
    )
    return {
        "doc_type": "item",
        "ref_id": f"{row['project_id']}/{row['item_id']}",
        "org_id": org_id,
        "project_id": row["project_id"],
        "title": row["title"],
        "body": body,
    }
