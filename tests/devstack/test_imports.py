"""The importers against the real data in ../shared/data.

Expected numbers are computed here from the files with deliberately simple code that does
not use the importers, then compared with what the backends serve over gRPC. The beads
import and search run on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from ballet.knowledge.v1 import knowledge_pb2
from ballet.skills.v1 import skills_pb2
from ballet.tracker.v1 import tracker_pb2

from devstack.importers.adr import import_adrs
from devstack.importers.beads import import_beads
from devstack.importers.skills import import_skills
from devstack.server import DevStack
from tests.devstack.fixtures import Clients, connect, metadata, start_stack

T = tracker_pb2
INTERNAL_TYPES = {"event", "molecule", "agent", "gate"}
PLAN_TYPES = {"epic", "task", "bug", "feature", "chore"}


@dataclass(frozen=True)
class Expected:
    """What the beads export holds after the filter, computed from the file alone."""

    types: Counter[str]
    blocks: set[tuple[str, str]]
    parent_child: set[tuple[str, str]]
    runnable: set[str]


def expected_from(path: Path) -> Expected:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = {
        row["id"]: row
        for row in rows
        if row["issue_type"] in PLAN_TYPES
        and row["issue_type"] not in INTERNAL_TYPES
        and row["status"] != "tombstone"
        and row.get("ephemeral") is not True
        and not row["id"].startswith("bd-wisp")
    }

    def links(kind: str) -> set[tuple[str, str]]:
        return {
            (row["id"], link["depends_on_id"])
            for row in kept.values()
            for link in row.get("dependencies") or []
            if link["type"] == kind and link["depends_on_id"] in kept
        }

    blocks = links("blocks")
    runnable = {
        item_id
        for item_id, row in kept.items()
        if row["issue_type"] != "epic"
        and row["status"] == "open"
        and all(
            kept[blocker]["status"] == "closed" for blocked, blocker in blocks if blocked == item_id
        )
    }
    return Expected(
        types=Counter(row["issue_type"] for row in kept.values()),
        blocks=blocks,
        parent_child=links("parent-child"),
        runnable=runnable,
    )


@dataclass(frozen=True)
class Served:
    """What the tracker serves for a project, read over gRPC."""

    items: dict[str, T.Item]
    runnable: list[str]


async def served(stack: DevStack, clients: Clients, project_id: str) -> Served:
    alice = metadata(stack, "alice")
    items: dict[str, T.Item] = {}
    token = ""
    while True:
        page = await clients.tracker.ListItems(
            T.ListItemsRequest(project_id=project_id, page_size=500, page_token=token),
            metadata=alice,
        )
        for item in page.items:
            assert item.item_id not in items, f"{item.item_id} served twice"
            items[item.item_id] = item
        token = page.next_page_token
        if not token:
            assert page.total_size == len(items)
            break
    runnable: list[str] = []
    token = ""
    while True:
        runnable_page = await clients.tracker.ListRunnableTickets(
            T.ListRunnableTicketsRequest(project_id=project_id, page_size=25, page_token=token),
            metadata=alice,
        )
        runnable += [item.item_id for item in runnable_page.items]
        token = runnable_page.next_page_token
        if not token:
            break
    return Served(items, runnable)


def check_beads(expected: Expected, got: Served) -> None:
    by_kind = Counter(item.kind for item in got.items.values())
    assert by_kind[T.ITEM_KIND_EPIC] == expected.types["epic"]
    tickets = Counter(
        item.ticket_type for item in got.items.values() if item.kind == T.ITEM_KIND_TICKET
    )
    assert tickets == Counter({t: n for t, n in expected.types.items() if t != "epic"})
    milestones = sorted(
        item.title for item in got.items.values() if item.kind == T.ITEM_KIND_MILESTONE
    )
    assert milestones == ["v0.30.7", "v0.32.1"]  # "Version Bump: 0.30.7" and "...: 0.32.1"
    blocks = {(item.item_id, b) for item in got.items.values() for b in item.blocked_by_ids}
    assert blocks == expected.blocks
    reverse = {(b, item.item_id) for item in got.items.values() for b in item.blocks_ids}
    assert reverse == expected.blocks
    # parent-child: the epic membership, plus parent:<id> labels for the rest (ADR 0102).
    memberships = {
        (item.item_id, item.epic_id)
        for item in got.items.values()
        if item.epic_id and item.kind != T.ITEM_KIND_MILESTONE
    }
    labelled = {
        (item.item_id, label.removeprefix("parent:"))
        for item in got.items.values()
        for label in item.labels
        if label.startswith("parent:")
    }
    assert memberships | labelled == expected.parent_child
    assert not memberships & labelled
    assert all(got.items[epic].kind == T.ITEM_KIND_EPIC for _item, epic in memberships)
    assert len(got.runnable) == len(set(got.runnable))
    assert set(got.runnable) == expected.runnable


async def check_search(stack: DevStack, clients: Clients, project_id: str) -> None:
    alice = metadata(stack, "alice")

    async def search(query: str) -> list[T.SearchResult]:
        response = await clients.tracker.SearchProject(
            T.SearchProjectRequest(project_id=project_id, query=query, page_size=5),
            metadata=alice,
        )
        return list(response.results)

    wasm = await search("WASM port sandboxes")
    assert "bd-44d0" in [result.item.item_id for result in wasm[:3]]
    typo = await search("daemn")  # a typo: trigram similarity of titles finds "daemon"
    assert typo and "daemon" in typo[0].item.title.lower()
    skills = await search("playwright browser testing")
    assert "webapp-testing" in [result.skill.name for result in skills if result.HasField("skill")]


@pytest.fixture(scope="module")
async def beads_stack(
    shared_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[DevStack]:
    stack = await start_stack(
        tmp_path_factory.mktemp("beads"),
        tracker_file=shared_data / "tracker" / "beads-issues.jsonl",
        project_id="beads",
        knowledge_dir=shared_data / "knowledge" / "adr",
        skills_dir=shared_data / "skills",
    )
    try:
        yield stack
    finally:
        await stack.stop()


@pytest.fixture(scope="module")
async def beads_clients(beads_stack: DevStack) -> AsyncIterator[Clients]:
    connected = connect(beads_stack.address)
    try:
        yield connected
    finally:
        await connected.channel.close()


def test_the_expectations_match_the_data_readme(shared_data: Path) -> None:
    expected = expected_from(shared_data / "tracker" / "beads-issues.jsonl")
    assert sum(expected.types.values()) == 1548
    assert expected.types["epic"] == 94
    assert (len(expected.blocks), len(expected.parent_child)) == (284, 282)


async def test_beads_import_serves_what_the_file_holds(
    shared_data: Path, beads_stack: DevStack, beads_clients: Clients
) -> None:
    expected = expected_from(shared_data / "tracker" / "beads-issues.jsonl")
    check_beads(expected, await served(beads_stack, beads_clients, "beads"))
    report = beads_stack.report.beads
    assert report is not None and report.seconds < 10


async def test_importing_twice_changes_nothing(
    shared_data: Path, beads_stack: DevStack, beads_clients: Clients
) -> None:
    before = await served(beads_stack, beads_clients, "beads")
    await import_beads(
        beads_stack.store, shared_data / "tracker" / "beads-issues.jsonl", project_id="beads"
    )
    adrs = await import_adrs(beads_stack.store, shared_data / "knowledge" / "adr")
    assert (adrs.created, adrs.updated, adrs.unchanged) == (0, 0, 45)
    skills = await import_skills(beads_stack.store, shared_data / "skills")
    assert skills.added == ()
    after = await served(beads_stack, beads_clients, "beads")
    assert after.items == before.items
    assert after.runnable == before.runnable


async def test_beads_search(beads_stack: DevStack, beads_clients: Clients) -> None:
    await check_search(beads_stack, beads_clients, "beads")


def _adr_status(path: Path) -> str:
    lines = path.read_text().splitlines()
    after = lines[lines.index("## Status") + 1 :]
    line = next(line for line in after if line.strip())
    return next(word for word in line.split() if word.isalpha()).lower()


async def test_adrs_are_decisions_with_status_and_supersession(
    shared_data: Path, beads_stack: DevStack, beads_clients: Clients
) -> None:
    folder = shared_data / "knowledge" / "adr"
    files = sorted(path for path in folder.glob("[0-9][0-9][0-9][0-9]-*.md"))
    bob = metadata(beads_stack, "bob")
    seen: dict[str, knowledge_pb2.KnowledgeEntry] = {}
    token = ""
    while True:
        page = await beads_clients.knowledge.SearchKnowledge(
            knowledge_pb2.SearchKnowledgeRequest(
                kind=knowledge_pb2.KNOWLEDGE_KIND_DECISION, page_size=20, page_token=token
            ),
            metadata=bob,
        )
        seen.update((hit.entry.entry_id, hit.entry) for hit in page.hits)
        token = page.next_page_token
        if not token:
            break
    assert sorted(seen) == [f"adr-{path.name[:4]}" for path in files]
    for path in files:
        assert seen[f"adr-{path.name[:4]}"].status == _adr_status(path), path.name

    async def get(entry_id: str) -> knowledge_pb2.KnowledgeEntry:
        response: knowledge_pb2.GetKnowledgeEntryResponse = (
            await beads_clients.knowledge.GetKnowledgeEntry(
                knowledge_pb2.GetKnowledgeEntryRequest(entry_id=entry_id), metadata=bob
            )
        )
        return response.entry

    old, new = await get("adr-0004"), await get("adr-0019")
    assert (old.status, list(old.superseded_by_ids)) == ("superseded", ["adr-0019"])
    assert (new.status, list(new.supersedes_ids)) == ("accepted", ["adr-0004"])
    assert "python" in old.title and old.body.startswith("Date: 2020-11-19")
    found = await beads_clients.knowledge.SearchKnowledge(
        knowledge_pb2.SearchKnowledgeRequest(query="core languages go"), metadata=bob
    )
    assert {"adr-0004", "adr-0019"} <= {hit.entry.entry_id for hit in found.hits[:3]}


async def test_skills_carry_front_matter(
    shared_data: Path, beads_stack: DevStack, beads_clients: Clients
) -> None:
    files = sorted((shared_data / "skills").glob("*/SKILL.md"))
    fronts = {}
    for path in files:
        text = path.read_text()
        front = yaml.safe_load(text.split("---\n")[1])
        fronts[front["name"]] = (front["description"], text)
    bob = metadata(beads_stack, "bob")
    listed = await beads_clients.skills.ListSkills(
        skills_pb2.ListSkillsRequest(project_id="beads"), metadata=bob
    )
    assert {skill.name: skill.description for skill in listed.skills} == {
        name: description for name, (description, _text) in fronts.items()
    }
    assert all(skill.scope == skills_pb2.SKILL_SCOPE_ORGANIZATION for skill in listed.skills)
    assert {skill.version for skill in listed.skills} == {"1.0.0"}
    for name, (_description, text) in fronts.items():
        read = await beads_clients.skills.ReadSkill(
            skills_pb2.ReadSkillRequest(project_id="beads", name=name), metadata=bob
        )
        assert read.content == text


async def test_a_changed_skill_gets_a_new_version(shared_data: Path, tmp_path: Path) -> None:
    folder = tmp_path / "skills"
    shutil.copytree(shared_data / "skills", folder)
    stack = await start_stack(tmp_path / "data", skills_dir=folder)
    clients = connect(stack.address)
    bob = metadata(stack, "bob")
    try:
        skill_file = folder / "internal-comms" / "SKILL.md"
        skill_file.chmod(0o644)
        changed = skill_file.read_text() + "\n## Added\n\nA changed skill gets a new version.\n"
        skill_file.write_text(changed)
        report = await import_skills(stack.store, folder)
        assert report.added == ("internal-comms@1.1.0",)
        assert (await import_skills(stack.store, folder)).added == ()
        read = await clients.skills.ReadSkill(
            skills_pb2.ReadSkillRequest(project_id="demo", name="internal-comms"), metadata=bob
        )
        assert (read.skill.version, read.skill.latest_version) == ("1.1.0", "1.1.0")
        assert read.content == changed
    finally:
        await clients.channel.close()
        await stack.stop()


@pytest.mark.postgres
async def test_beads_import_and_search_on_postgresql(
    shared_data: Path, pg_url: str, tmp_path: Path
) -> None:
    tracker_file = shared_data / "tracker" / "beads-issues.jsonl"
    stack = await start_stack(
        tmp_path,
        database_url=pg_url,
        tracker_file=tracker_file,
        project_id="beads",
        knowledge_dir=shared_data / "knowledge" / "adr",
        skills_dir=shared_data / "skills",
    )
    clients = connect(stack.address)
    try:
        assert stack.store.dialect == "postgresql"
        expected = expected_from(tracker_file)
        first = await served(stack, clients, "beads")
        check_beads(expected, first)
        await check_search(stack, clients, "beads")
        await import_beads(stack.store, tracker_file, project_id="beads")
        again = await served(stack, clients, "beads")
        assert again.items == first.items
        found = await clients.knowledge.SearchKnowledge(
            knowledge_pb2.SearchKnowledgeRequest(query="core languages go"),
            metadata=metadata(stack, "bob"),
        )
        assert {"adr-0004", "adr-0019"} <= {hit.entry.entry_id for hit in found.hits[:3]}
        # Concurrent repeats of one write race on the idempotency key: one write wins.
        request = knowledge_pb2.CreateKnowledgeEntryRequest(
            request_id="pg-race",
            kind=knowledge_pb2.KNOWLEDGE_KIND_NOTE,
            title="Racing",
            project_id="beads",
            item_ids=["bd-44d0"],
        )
        alice = metadata(stack, "alice")
        answers = await asyncio.gather(
            *(clients.knowledge.CreateKnowledgeEntry(request, metadata=alice) for _ in range(8))
        )
        assert len({answer.entry.entry_id for answer in answers}) == 1
        assert stack.writes["pg-race"] == 1
    finally:
        await clients.channel.close()
        await stack.stop()
