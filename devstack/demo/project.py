"""The built-in demo project ``demo`` of organization ``acme``, written for this repository.

A small household-pantry app: two milestones, four epics, fifteen tickets with
dependencies (five runnable, the others blocked, in progress or closed), three knowledge
entries (a decision, a note, a debt record), and skills that show resolution rules:

- ``demo-planning`` (project skill, versions 1.0.0 and 1.1.0; the project pins 1.0.0, the
  OLDER one, so a test can tell pin from latest); it is the project's ``planner.skill``.
- ``release-notes`` exists as an organization skill and as a project skill: the project's
  hides the organization's.
- ``ticket-writing`` is an organization skill every acme project sees.

Also the tiny ``globex-ops`` project of organization ``globex`` (carol's), so isolation
tests have something on the other side. Loading is an upsert: running it again changes
nothing.
"""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from devstack.importers.beads import upsert_items
from devstack.store import Store
from devstack.store import knowledge as knowledge_store
from devstack.store.access import put_project
from devstack.store.schema import dependencies
from devstack.store.skills import pin, put_skill_version

PROJECT_ID = "demo"
ORG_ID = "acme"
PLANNER_SKILL = "demo-planning"
MODEL_CREDENTIAL = "demo-credential"
GLOBEX_PROJECT_ID = "globex-ops"

# (id, kind, title, state, priority, ticket type, epic, milestone, blocked by, description,
#  acceptance criteria)
_ITEMS: list[tuple[str, str, str, str, int, str, str, str, tuple[str, ...], str, str]] = [
    ("PAN-1", "milestone", "Alpha: a shared pantry list", "open", 1, "", "", "", (),
     "Households can share one pantry list on their phones.", ""),
    ("PAN-2", "milestone", "Beta: shopping and expiry reminders", "open", 2, "", "", "", (),
     "The app turns the pantry into a shopping list and warns before food expires.", ""),
    ("PAN-3", "epic", "Accounts and households", "in_progress", 1, "", "", "PAN-1", (),
     "People sign up, form a household and invite the others who share the kitchen.", ""),
    ("PAN-4", "epic", "Pantry inventory", "open", 1, "", "", "PAN-1", (),
     "What is in the cupboard: items, quantities, units and best-before dates.", ""),
    ("PAN-5", "epic", "Shopping list", "open", 2, "", "", "PAN-2", ("PAN-4",),
     "A shopping list built from what runs low, usable in a shop with bad reception.", ""),
    ("PAN-6", "epic", "Expiry reminders", "open", 2, "", "", "PAN-2", ("PAN-4",),
     "Remind the household of food that expires soon, before it is thrown away.", ""),
    ("PAN-7", "ticket", "Sign-up with e-mail and password", "closed", 1, "task", "PAN-3",
     "PAN-1", (), "A sign-up form, password hashing with a modern KDF, e-mail confirmation.",
     "- A new person can sign up and log in\n- Passwords are never stored in clear"),
    ("PAN-8", "ticket", "Invite a member to a household", "in_progress", 1, "feature",
     "PAN-3", "PAN-1", ("PAN-7",),
     "The household owner sends an invitation link; the invitee joins after signing up.",
     "- An invitation link expires after 7 days\n- A member sees the household's pantry"),
    ("PAN-9", "ticket", "Session expires after 5 minutes instead of 12 hours", "open", 0,
     "bug", "PAN-3", "PAN-1", (),
     "Users are logged out while cooking. The session lifetime setting is read in seconds "
     "but written in minutes.", "- A session lasts 12 hours of inactivity"),
    ("PAN-10", "ticket", "Item model: name, quantity, unit, best-before date", "closed", 1,
     "task", "PAN-4", "PAN-1", (), "The pantry item table and its API representation.",
     "- Items have a name, a decimal quantity, a unit and an optional best-before date"),
    ("PAN-11", "ticket", "Add and edit pantry items", "open", 1, "feature", "PAN-4", "PAN-1",
     ("PAN-10",), "Screens to add an item, change its quantity and remove it.",
     "- Adding an item takes at most three taps\n- Edits sync to every member within 5 s"),
    ("PAN-12", "ticket", "Barcode lookup when adding an item", "open", 3, "feature",
     "PAN-4", "PAN-1", ("PAN-11",),
     "Scan a barcode to fill in the item's name and usual unit from an open product "
     "database.", "- A known barcode fills in name and unit"),
    ("PAN-13", "ticket", "Seed the unit list (g, kg, ml, l, pieces)", "open", 2, "chore",
     "PAN-4", "PAN-1", (), "A migration that inserts the standard units.", ""),
    ("PAN-14", "ticket", "Search pantry items by name", "open", 2, "task", "PAN-4", "PAN-1",
     ("PAN-11",), "Type-ahead search over the household's items, tolerant of typos.",
     "- Searching 'tomatos' finds 'Tomatoes'"),
    ("PAN-15", "ticket", "Generate a shopping list from low-stock items", "open", 2,
     "feature", "PAN-5", "PAN-2", ("PAN-11",),
     "Items below their minimum quantity go on the shopping list automatically.",
     "- Low-stock items appear on the list once"),
    ("PAN-16", "ticket", "Tick items off while shopping, offline", "open", 2, "feature",
     "PAN-5", "PAN-2", ("PAN-15",),
     "The list works without a connection and syncs when the phone is back online.",
     "- Ticking items off works in airplane mode"),
    ("PAN-17", "ticket", "Quantities with decimals are rounded down", "open", 1, "bug",
     "PAN-5", "PAN-2", ("PAN-10",),
     "1.5 l of milk is shown as 1 l: the API serializes quantities as integers.",
     "- 1.5 stays 1.5 everywhere"),
    ("PAN-18", "ticket", "Daily job that finds items expiring within 3 days", "open", 2,
     "task", "PAN-6", "PAN-2", ("PAN-10",),
     "A scheduled job per household, in the household's time zone.", ""),
    ("PAN-19", "ticket", "Push notification for expiring items", "open", 2, "feature",
     "PAN-6", "PAN-2", ("PAN-18", "PAN-8"),
     "One notification a day listing what expires soon, sent to every member.",
     "- Members can open the item from the notification"),
    ("PAN-20", "ticket", "Notification settings per member", "blocked", 3, "task", "PAN-6",
     "PAN-2", (), "Waiting for the design team's settings screen.", ""),
    ("PAN-21", "ticket", "Set up CI with lint and tests", "closed", 2, "chore", "", "", (),
     "Run the linters and the test suite on every pull request.", ""),
]  # fmt: skip

#: An execution policy a human set on one ticket (only humans may; docs/spec/authority.md).
_POLICIES = {"PAN-13": {"mode": "auto", "settings": {"agent": "chore-bot"}}}

_KNOWLEDGE: list[dict[str, Any]] = [
    {
        "slug": "decimal-quantities",
        "kind": "decision",
        "title": "Store quantities as decimal strings",
        "status": "accepted",
        "item_ids": ["PAN-10", "PAN-17"],
        "body": (
            "## Context\n\nQuantities like 1.5 l were rounded (PAN-17) because the API used "
            "integers, and binary floats would show 0.30000000000000004 g.\n\n## Decision\n\n"
            "Quantities are decimal strings in the API and NUMERIC(12, 3) in the database.\n\n"
            "## Consequences\n\nClients parse decimals; sorting by quantity happens on the "
            "server."
        ),
    },
    {
        "slug": "household-interviews",
        "kind": "note",
        "title": "Notes from the household interviews",
        "status": "",
        "item_ids": ["PAN-8", "PAN-19"],
        "body": (
            "Five households interviewed. Everyone shares one shopping list per kitchen; "
            "two households have a member without a smartphone, so invitations must also "
            "work by e-mail. Expiry reminders were the most wanted feature, but only once a "
            "day: more is noise."
        ),
    },
    {
        "slug": "session-config-debt",
        "kind": "debt",
        "title": "Session settings mix seconds and minutes",
        "status": "open",
        "item_ids": ["PAN-9"],
        "body": (
            "The auth settings read some durations in seconds and others in minutes "
            "(the cause of PAN-9). Move every duration to an explicit unit suffix."
        ),
    },
]

_DEMO_PLANNING_1_0 = """---
name: demo-planning
description: How the demo project plans work - small tickets, explicit acceptance criteria.
---

# Planning the demo project (1.0.0)

- Keep tickets small: one screen, one job or one migration each.
- Every ticket has acceptance criteria a tester can check.
- Propose dependencies when a ticket needs another's code; never set execution policies.
"""

_DEMO_PLANNING_1_1 = """---
name: demo-planning
description: How the demo project plans work - small tickets, acceptance criteria, milestones.
---

# Planning the demo project (1.1.0)

- Keep tickets small: one screen, one job or one migration each.
- Every ticket has acceptance criteria a tester can check.
- Every epic aims at a milestone; say which when proposing one.
- Propose dependencies when a ticket needs another's code; never set execution policies.
"""

_ORG_SKILLS = {
    "ticket-writing": (
        "How acme writes tickets: a title that says the outcome, then context.",
        "---\nname: ticket-writing\ndescription: How acme writes tickets: a title that says "
        "the outcome, then context.\n---\n\n# Writing tickets\n\nTitle: the outcome, not the "
        "activity. Body: why, then what. End with acceptance criteria.\n",
    ),
    "release-notes": (
        "Organization-wide release notes format.",
        "---\nname: release-notes\ndescription: Organization-wide release notes format.\n---\n"
        "\n# Release notes (organization)\n\nGroup changes by product area.\n",
    ),
}

_PROJECT_RELEASE_NOTES = (
    "The demo project's release notes format, for app store listings.",
    "---\nname: release-notes\ndescription: The demo project's release notes format, for app "
    "store listings.\n---\n\n# Release notes (demo project)\n\nAt most five bullet points, "
    "written for households, no ticket ids.\n",
)


def _item_rows(project_id: str) -> list[dict[str, Any]]:
    # Fixed times keep re-loads idempotent (an upsert with new times would "change" rows).
    base = 1_767_225_600.0  # 2026-01-01T00:00:00Z
    rows = []
    for index, entry in enumerate(_ITEMS):
        item_id, kind, title, state, priority, ticket_type, epic, milestone, _blockers, desc, ac = (
            entry
        )
        rows.append(
            {
                "project_id": project_id,
                "item_id": item_id,
                "kind": kind,
                "title": title,
                "description": desc,
                "acceptance_criteria": ac,
                "state": state,
                "priority": priority,
                "ticket_type": ticket_type,
                "epic_id": epic,
                "milestone_id": milestone,
                "policy": _POLICIES.get(item_id),
                "labels": [],
                "source": "demo",
                "create_time": base + index * 3600,
                "update_time": base + index * 3600,
            }
        )
    return rows


async def load_demo(store: Store) -> None:
    """Create or refresh the demo project, its knowledge and skills (one transaction)."""
    await store.run_write(_load_demo)


async def _load_demo(session: AsyncSession) -> None:
    await put_project(
        session,
        project_id=PROJECT_ID,
        org_id=ORG_ID,
        name="Pantry (demo)",
        description="A household pantry app: the built-in demo project of ballet-planner dev.",
        settings={"planner.skill": PLANNER_SKILL, "planner.model_credential": MODEL_CREDENTIAL},
    )
    await upsert_items(session, _item_rows(PROJECT_ID), org_id=ORG_ID)
    await session.execute(sa.delete(dependencies).where(dependencies.c.project_id == PROJECT_ID))
    await session.execute(
        sa.insert(dependencies),
        [
            {"project_id": PROJECT_ID, "item_id": entry[0], "blocked_by_id": blocker}
            for entry in _ITEMS
            for blocker in entry[8]
        ],
    )
    for entry in _KNOWLEDGE:
        await _put_entry(session, entry, org_id=ORG_ID, project_id=PROJECT_ID, author="alice")
    for name, (description, content) in _ORG_SKILLS.items():
        await put_skill_version(
            session, org_id=ORG_ID, project_id="", name=name, description=description,
            content=content, version="1.0.0",
        )  # fmt: skip
    for version, content in (("1.0.0", _DEMO_PLANNING_1_0), ("1.1.0", _DEMO_PLANNING_1_1)):
        description = content.split("description: ", 1)[1].split("\n", 1)[0]
        await put_skill_version(
            session, org_id=ORG_ID, project_id=PROJECT_ID, name=PLANNER_SKILL,
            description=description, content=content, version=version,
        )  # fmt: skip
    description, content = _PROJECT_RELEASE_NOTES
    await put_skill_version(
        session, org_id=ORG_ID, project_id=PROJECT_ID, name="release-notes",
        description=description, content=content, version="1.0.0",
    )  # fmt: skip
    await pin(session, org_id=ORG_ID, project_id=PROJECT_ID, name=PLANNER_SKILL, version="1.0.0")


async def load_globex(store: Store) -> None:
    """Create the ``globex-ops`` project of organization ``globex`` (carol's) if missing."""

    async def unit(session: AsyncSession) -> None:
        await put_project(
            session,
            project_id=GLOBEX_PROJECT_ID,
            org_id="globex",
            name="Globex operations",
            description="Another organization's project, for isolation tests.",
            settings={"planner.model_credential": "globex-credential"},
        )
        row = {
            "project_id": GLOBEX_PROJECT_ID,
            "item_id": "OPS-1",
            "kind": "ticket",
            "title": "Rotate the on-call schedule",
            "description": "Move the on-call rota to the new calendar.",
            "acceptance_criteria": "",
            "state": "open",
            "priority": 2,
            "ticket_type": "task",
            "epic_id": "",
            "milestone_id": "",
            "policy": None,
            "labels": [],
            "source": "demo",
            "create_time": 1_767_225_600.0,
            "update_time": 1_767_225_600.0,
        }
        await upsert_items(session, [row], org_id="globex")
        await _put_entry(
            session,
            {
                "slug": "globex-oncall",
                "kind": "note",
                "title": "Globex on-call rota",
                "status": "",
                "item_ids": ["OPS-1"],
                "body": "The on-call rota lives in the operations calendar.",
            },
            org_id="globex",
            project_id=GLOBEX_PROJECT_ID,
            author="carol",
        )

    await store.run_write(unit)


async def _put_entry(
    session: AsyncSession, entry: dict[str, Any], *, org_id: str, project_id: str, author: str
) -> None:
    source_id = f"demo:{org_id}:{entry['slug']}"
    if await knowledge_store.entry_id_for_source(session, source_id) is not None:
        return
    await knowledge_store.create_entry(
        session,
        org_id=org_id,
        kind=entry["kind"],
        title=entry["title"],
        body=entry["body"],
        status=entry["status"],
        project_ids=[project_id],
        item_ids=entry["item_ids"],
        author_id=author,
        recorded_by=author,
        entry_id=f"ke-{entry['slug']}",
        source_id=source_id,
        create_time=time.time(),
    )
