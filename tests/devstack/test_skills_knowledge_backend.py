"""The skills and knowledge backends on the demo project: resolution and pins, knowledge
versions (stale updates ABORTED), idempotent writes, attribution. docs/spec/authority.md and
README.md."""

from __future__ import annotations

import uuid

import grpc
from ballet.knowledge.v1 import knowledge_pb2
from ballet.skills.v1 import skills_pb2

from ballet_common.tokens import KNOWLEDGE_AUDIENCE
from devstack.server import DevStack
from tests.devstack.fixtures import Clients, clients, demo_stack, metadata, rpc_error

__all__ = ["clients", "demo_stack"]

K = knowledge_pb2


async def test_list_skills_resolves_pins_and_scopes(demo_stack: DevStack, clients: Clients) -> None:
    response = await clients.skills.ListSkills(
        skills_pb2.ListSkillsRequest(project_id="demo"), metadata=metadata(demo_stack, "bob")
    )
    skills = {skill.name: skill for skill in response.skills}
    assert list(skills) == ["demo-planning", "release-notes", "ticket-writing"]
    planning = skills["demo-planning"]
    assert (planning.version, planning.pinned, planning.latest_version) == ("1.0.0", True, "1.1.0")
    assert planning.scope == skills_pb2.SKILL_SCOPE_PROJECT
    notes = skills["release-notes"]
    assert notes.scope == skills_pb2.SKILL_SCOPE_PROJECT  # hides the organization's
    assert "demo project" in notes.description
    writing = skills["ticket-writing"]
    assert writing.scope == skills_pb2.SKILL_SCOPE_ORGANIZATION
    assert (writing.version, writing.pinned) == ("1.0.0", False)
    seen: list[str] = []
    token = ""
    while True:
        page = await clients.skills.ListSkills(
            skills_pb2.ListSkillsRequest(project_id="demo", page_size=1, page_token=token),
            metadata=metadata(demo_stack, "bob"),
        )
        seen += [skill.name for skill in page.skills]
        token = page.next_page_token
        if not token:
            break
    assert seen == list(skills)


async def test_read_skill_returns_the_resolved_version(
    demo_stack: DevStack, clients: Clients
) -> None:
    bob = metadata(demo_stack, "bob")
    planning = await clients.skills.ReadSkill(
        skills_pb2.ReadSkillRequest(project_id="demo", name="demo-planning"), metadata=bob
    )
    assert planning.skill.version == "1.0.0"
    assert planning.content.startswith("---\nname: demo-planning")
    assert "(1.0.0)" in planning.content and "(1.1.0)" not in planning.content
    refusal = await rpc_error(
        clients.skills.ReadSkill(
            skills_pb2.ReadSkillRequest(project_id="demo", name="no-such-skill"), metadata=bob
        )
    )
    assert (refusal.code, refusal.reason) == (grpc.StatusCode.NOT_FOUND, "SKILL_NOT_FOUND")
    # globex's project does not see acme's skills.
    refusal = await rpc_error(
        clients.skills.ReadSkill(
            skills_pb2.ReadSkillRequest(project_id="globex-ops", name="ticket-writing"),
            metadata=metadata(demo_stack, "carol"),
        )
    )
    assert refusal.code == grpc.StatusCode.NOT_FOUND


async def test_search_and_get_knowledge(demo_stack: DevStack, clients: Clients) -> None:
    bob = metadata(demo_stack, "bob")
    found = await clients.knowledge.SearchKnowledge(
        K.SearchKnowledgeRequest(query="decimal quantities"), metadata=bob
    )
    top = found.hits[0]
    assert top.entry.entry_id == "ke-decimal-quantities"
    assert top.entry.body == ""  # hits leave the body out
    assert "decimal" in top.snippet.lower()
    notes = await clients.knowledge.SearchKnowledge(
        K.SearchKnowledgeRequest(query="households", kind=K.KNOWLEDGE_KIND_NOTE), metadata=bob
    )
    assert {hit.entry.kind for hit in notes.hits} == {K.KNOWLEDGE_KIND_NOTE}
    listed = await clients.knowledge.SearchKnowledge(
        K.SearchKnowledgeRequest(kind=K.KNOWLEDGE_KIND_DEBT, page_size=1), metadata=bob
    )
    assert [hit.entry.entry_id for hit in listed.hits] == ["ke-session-config-debt"]
    entry = (
        await clients.knowledge.GetKnowledgeEntry(
            K.GetKnowledgeEntryRequest(entry_id="ke-decimal-quantities"), metadata=bob
        )
    ).entry
    assert entry.kind == K.KNOWLEDGE_KIND_DECISION and entry.status == "accepted"
    assert list(entry.project_ids) == ["demo"] and "PAN-17" in entry.item_ids
    assert entry.version == 1 and "NUMERIC" in entry.body
    refusal = await rpc_error(
        clients.knowledge.GetKnowledgeEntry(
            K.GetKnowledgeEntryRequest(entry_id="ke-nope"), metadata=bob
        )
    )
    assert (refusal.code, refusal.reason) == (grpc.StatusCode.NOT_FOUND, "ENTRY_NOT_FOUND")


async def test_create_knowledge_is_attributed_and_idempotent(
    demo_stack: DevStack, clients: Clients
) -> None:
    planner = metadata(demo_stack, "alice", actor="planner:s-9", planner=KNOWLEDGE_AUDIENCE)
    request = K.CreateKnowledgeEntryRequest(
        request_id=f"tool-{uuid.uuid4().hex}",
        kind=K.KNOWLEDGE_KIND_DEBT,
        title="Barcode lookup has no offline cache",
        body="Scanning without a connection fails.",
        status="open",
        project_id="demo",
        item_ids=["PAN-12", "PAN-16"],
    )
    entry = (await clients.knowledge.CreateKnowledgeEntry(request, metadata=planner)).entry
    assert (entry.author_id, entry.recorded_by, entry.version) == ("alice", "planner:s-9", 1)
    assert list(entry.item_ids) == ["PAN-12", "PAN-16"]
    assert entry.organization_id == "acme"
    again = (await clients.knowledge.CreateKnowledgeEntry(request, metadata=planner)).entry
    assert again == entry and demo_stack.writes[request.request_id] == 1
    request.title = "Different"
    refusal = await rpc_error(clients.knowledge.CreateKnowledgeEntry(request, metadata=planner))
    assert (refusal.code, refusal.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_ID_REUSED")
    found = await clients.knowledge.SearchKnowledge(
        K.SearchKnowledgeRequest(query="offline cache barcode"),
        metadata=metadata(demo_stack, "bob"),
    )
    assert found.hits[0].entry.entry_id == entry.entry_id


async def test_create_knowledge_checks_project_and_items(
    demo_stack: DevStack, clients: Clients
) -> None:
    alice = metadata(demo_stack, "alice")

    def request(**fields: object) -> K.CreateKnowledgeEntryRequest:
        base: dict[str, object] = {
            "request_id": f"kn-{uuid.uuid4().hex}",
            "kind": K.KNOWLEDGE_KIND_NOTE,
            "title": "A note",
            "project_id": "demo",
        }
        base.update(fields)
        return K.CreateKnowledgeEntryRequest(**base)  # type: ignore[arg-type]

    cases = [
        (request(item_ids=["PAN-404"]), grpc.StatusCode.NOT_FOUND, "ITEM_NOT_FOUND"),
        (request(item_ids=["OPS-1"]), grpc.StatusCode.NOT_FOUND, "ITEM_NOT_FOUND"),
        (request(project_id="globex-ops"), grpc.StatusCode.NOT_FOUND, "PROJECT_NOT_FOUND"),
        (
            request(project_id="", item_ids=["PAN-9"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "PROJECT_REQUIRED",
        ),
        (
            request(kind=K.KNOWLEDGE_KIND_UNSPECIFIED),
            grpc.StatusCode.INVALID_ARGUMENT,
            "KIND_REQUIRED",
        ),
        (request(title=" "), grpc.StatusCode.INVALID_ARGUMENT, "TITLE_REQUIRED"),
    ]
    for bad, code, reason in cases:
        refusal = await rpc_error(clients.knowledge.CreateKnowledgeEntry(bad, metadata=alice))
        assert (refusal.code, refusal.reason) == (code, reason), bad
        assert bad.request_id not in demo_stack.writes


async def test_update_needs_the_version_read(demo_stack: DevStack, clients: Clients) -> None:
    alice = metadata(demo_stack, "alice")
    created = (
        await clients.knowledge.CreateKnowledgeEntry(
            K.CreateKnowledgeEntryRequest(
                request_id=f"kn-{uuid.uuid4().hex}",
                kind=K.KNOWLEDGE_KIND_DOCUMENT,
                title="Sync protocol",
                body="v1",
                project_id="demo",
            ),
            metadata=alice,
        )
    ).entry
    first = K.UpdateKnowledgeEntryRequest(
        request_id=f"up-{uuid.uuid4().hex}",
        entry_id=created.entry_id,
        version=1,
        body="v2",
        item_ids=["PAN-16"],
        replace_item_ids=True,
    )
    planner = metadata(demo_stack, "alice", actor="planner:s-3", planner=KNOWLEDGE_AUDIENCE)
    updated = (await clients.knowledge.UpdateKnowledgeEntry(first, metadata=planner)).entry
    assert (updated.version, updated.body, list(updated.item_ids)) == (2, "v2", ["PAN-16"])
    assert (updated.author_id, updated.recorded_by) == ("alice", "planner:s-3")
    assert updated.title == "Sync protocol"  # unset fields stay as they are
    stale = K.UpdateKnowledgeEntryRequest(
        request_id=f"up-{uuid.uuid4().hex}", entry_id=created.entry_id, version=1, body="v2b"
    )
    refusal = await rpc_error(clients.knowledge.UpdateKnowledgeEntry(stale, metadata=alice))
    assert (refusal.code, refusal.reason) == (grpc.StatusCode.ABORTED, "STALE_VERSION")
    assert refusal.info.metadata["current_version"] == "2"
    third = K.UpdateKnowledgeEntryRequest(
        request_id=f"up-{uuid.uuid4().hex}", entry_id=created.entry_id, version=2, status="draft"
    )
    assert (await clients.knowledge.UpdateKnowledgeEntry(third, metadata=alice)).entry.version == 3
    # A retry of the first update replays its result; it is not a stale write.
    replay = (await clients.knowledge.UpdateKnowledgeEntry(first, metadata=planner)).entry
    assert replay == updated
    assert demo_stack.writes[first.request_id] == 1
    current = (
        await clients.knowledge.GetKnowledgeEntry(
            K.GetKnowledgeEntryRequest(entry_id=created.entry_id), metadata=alice
        )
    ).entry
    assert (current.version, current.status, current.body) == (3, "draft", "v2")
    cleared = K.UpdateKnowledgeEntryRequest(
        request_id=f"up-{uuid.uuid4().hex}",
        entry_id=created.entry_id,
        version=3,
        replace_item_ids=True,
    )
    assert not (
        await clients.knowledge.UpdateKnowledgeEntry(cleared, metadata=alice)
    ).entry.item_ids
    for bad, code, reason in (
        (
            K.UpdateKnowledgeEntryRequest(entry_id="ke-nope", version=1, body="x"),
            grpc.StatusCode.NOT_FOUND,
            "ENTRY_NOT_FOUND",
        ),
        (
            K.UpdateKnowledgeEntryRequest(entry_id=created.entry_id, body="x"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "VERSION_REQUIRED",
        ),
        (
            K.UpdateKnowledgeEntryRequest(
                entry_id=created.entry_id, version=4, item_ids=["PAN-404"], replace_item_ids=True
            ),
            grpc.StatusCode.NOT_FOUND,
            "ITEM_NOT_FOUND",
        ),
    ):
        refusal = await rpc_error(clients.knowledge.UpdateKnowledgeEntry(bad, metadata=alice))
        assert (refusal.code, refusal.reason) == (code, reason)


async def test_forged_actor_is_not_recorded_as_the_planner(
    demo_stack: DevStack, clients: Clients
) -> None:
    forged = metadata(demo_stack, "alice", actor="planner:s-4")
    entry = (
        await clients.knowledge.CreateKnowledgeEntry(
            K.CreateKnowledgeEntryRequest(
                request_id=f"kn-{uuid.uuid4().hex}",
                kind=K.KNOWLEDGE_KIND_NOTE,
                title="Forged",
                project_id="demo",
            ),
            metadata=forged,
        )
    ).entry
    assert (entry.author_id, entry.recorded_by) == ("alice", "alice")
    record = demo_stack.calls_for("CreateKnowledgeEntry")[-1]
    assert (record.actor, record.actor_header, record.actor_forged) == ("", "planner:s-4", True)
