"""Every backend RPC checks the token (audience included) and the human's permissions.

docs/spec/authority.md (identity and the permissions tools need).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from ballet.knowledge.v1 import knowledge_pb2
from ballet.skills.v1 import skills_pb2
from ballet.tracker.v1 import tracker_pb2
from google.protobuf.message import Message

from ballet_common.tokens import (
    HUMAN_AUDIENCES,
    KNOWLEDGE_AUDIENCE,
    SKILLS_AUDIENCE,
    TRACKER_AUDIENCE,
    mint_dev_token,
)
from devstack.server import DevStack
from tests.devstack.fixtures import Clients, clients, demo_stack, metadata, rpc_error

__all__ = ["clients", "demo_stack"]

AUDIENCE = {"tracker": TRACKER_AUDIENCE, "skills": SKILLS_AUDIENCE, "knowledge": KNOWLEDGE_AUDIENCE}


def _propose() -> Message:
    return tracker_pb2.ProposeChangesetRequest(
        request_id=f"req-{uuid.uuid4().hex}",
        project_id="demo",
        title="Search needs the unit list",
        operations=[
            tracker_pb2.ChangesetOperation(
                dependency=tracker_pb2.DependencyOperation(item_id="PAN-14", blocked_by_id="PAN-13")
            )
        ],
    )


def _create() -> Message:
    return knowledge_pb2.CreateKnowledgeEntryRequest(
        request_id=f"req-{uuid.uuid4().hex}",
        kind=knowledge_pb2.KNOWLEDGE_KIND_NOTE,
        title="Session bug seen again",
        body="Logged out after five minutes while cooking.",
        project_id="demo",
        item_ids=["PAN-9"],
    )


def _update() -> Message:
    return knowledge_pb2.UpdateKnowledgeEntryRequest(
        request_id=f"req-{uuid.uuid4().hex}",
        entry_id="ke-household-interviews",
        version=1,
        body="Five households interviewed (updated).",
    )


# (backend, RPC, request factory, needs a write permission, names a project)
RPCS: list[tuple[str, str, Callable[[], Message], bool, bool]] = [
    (
        "tracker",
        "GetProject",
        lambda: tracker_pb2.GetProjectRequest(project_id="demo"),
        False,
        True,
    ),
    ("tracker", "ListItems", lambda: tracker_pb2.ListItemsRequest(project_id="demo"), False, True),
    (
        "tracker",
        "GetItem",
        lambda: tracker_pb2.GetItemRequest(project_id="demo", item_id="PAN-11"),
        False,
        True,
    ),
    (
        "tracker",
        "ListRunnableTickets",
        lambda: tracker_pb2.ListRunnableTicketsRequest(project_id="demo"),
        False,
        True,
    ),
    (
        "tracker",
        "SearchProject",
        lambda: tracker_pb2.SearchProjectRequest(project_id="demo", query="pantry items"),
        False,
        True,
    ),
    (
        "tracker",
        "ListChangesets",
        lambda: tracker_pb2.ListChangesetsRequest(project_id="demo"),
        False,
        True,
    ),
    ("tracker", "ProposeChangeset", _propose, True, True),
    ("skills", "ListSkills", lambda: skills_pb2.ListSkillsRequest(project_id="demo"), False, True),
    (
        "skills",
        "ReadSkill",
        lambda: skills_pb2.ReadSkillRequest(project_id="demo", name="demo-planning"),
        False,
        True,
    ),
    (
        "knowledge",
        "SearchKnowledge",
        lambda: knowledge_pb2.SearchKnowledgeRequest(query="decimal"),
        False,
        False,
    ),
    (
        "knowledge",
        "GetKnowledgeEntry",
        lambda: knowledge_pb2.GetKnowledgeEntryRequest(entry_id="ke-decimal-quantities"),
        False,
        False,
    ),
    ("knowledge", "CreateKnowledgeEntry", _create, True, False),
    ("knowledge", "UpdateKnowledgeEntry", _update, True, False),
]
ALL = [pytest.param(backend, rpc, make, id=rpc) for backend, rpc, make, _w, _p in RPCS]
WRITES = [pytest.param(backend, rpc, make, id=rpc) for backend, rpc, make, w, _p in RPCS if w]
READS = [pytest.param(backend, rpc, make, id=rpc) for backend, rpc, make, w, _p in RPCS if not w]
PROJECT_READS = [
    pytest.param(backend, rpc, make, id=rpc)
    for backend, rpc, make, w, project in RPCS
    if project and not w
]


def _call(clients: Clients, backend: str, rpc: str, request: Message, md: Any) -> Any:
    return getattr(getattr(clients, backend), rpc)(request, metadata=md, timeout=10)


def test_the_table_covers_every_backend_rpc() -> None:
    services = {
        "tracker": tracker_pb2.DESCRIPTOR.services_by_name["TrackerService"],
        "skills": skills_pb2.DESCRIPTOR.services_by_name["SkillsService"],
        "knowledge": knowledge_pb2.DESCRIPTOR.services_by_name["KnowledgeService"],
    }
    declared = {(name, method.name) for name, svc in services.items() for method in svc.methods}
    assert {(backend, rpc) for backend, rpc, *_ in RPCS} == declared


@pytest.mark.parametrize(("backend", "rpc", "make"), ALL)
async def test_missing_token_is_unauthenticated(
    demo_stack: DevStack, clients: Clients, backend: str, rpc: str, make: Callable[[], Message]
) -> None:
    refusal = await rpc_error(_call(clients, backend, rpc, make(), ()))
    assert refusal.code == grpc.StatusCode.UNAUTHENTICATED
    assert refusal.reason == "TOKEN_MISSING"
    assert refusal.info.domain == f"{backend}.ballet"
    record = demo_stack.calls_for(rpc)[-1]
    assert (record.human, record.code) == ("", grpc.StatusCode.UNAUTHENTICATED)


@pytest.mark.parametrize(("backend", "rpc", "make"), ALL)
async def test_a_token_without_this_backends_audience_is_refused(
    demo_stack: DevStack, clients: Clients, backend: str, rpc: str, make: Callable[[], Message]
) -> None:
    others = [audience for audience in HUMAN_AUDIENCES if audience != AUDIENCE[backend]]
    md = metadata(demo_stack, "alice", audiences=others)
    refusal = await rpc_error(_call(clients, backend, rpc, make(), md))
    assert (refusal.code, refusal.reason) == (grpc.StatusCode.UNAUTHENTICATED, "WRONG_AUDIENCE")


@pytest.mark.parametrize(("backend", "rpc", "make"), ALL)
async def test_expired_and_forged_tokens_are_refused(
    demo_stack: DevStack, clients: Clients, backend: str, rpc: str, make: Callable[[], Message]
) -> None:
    expired = metadata(demo_stack, "alice", ttl_s=-3600)
    refusal = await rpc_error(_call(clients, backend, rpc, make(), expired))
    assert (refusal.code, refusal.reason) == (grpc.StatusCode.UNAUTHENTICATED, "TOKEN_EXPIRED")
    forged = (
        (
            "authorization",
            f"Bearer {mint_dev_token(b'not-the-secret-of-this-devstack-0123456789', 'alice')}",
        ),
    )
    refusal = await rpc_error(_call(clients, backend, rpc, make(), forged))
    assert (refusal.code, refusal.reason) == (grpc.StatusCode.UNAUTHENTICATED, "TOKEN_INVALID")


@pytest.mark.parametrize(("backend", "rpc", "make"), ALL)
async def test_alice_may_call_every_rpc(
    demo_stack: DevStack, clients: Clients, backend: str, rpc: str, make: Callable[[], Message]
) -> None:
    await _call(clients, backend, rpc, make(), metadata(demo_stack, "alice"))
    record = demo_stack.calls_for(rpc)[-1]
    assert (record.human, record.code) == ("alice", grpc.StatusCode.OK)


@pytest.mark.parametrize(("backend", "rpc", "make"), WRITES)
async def test_bob_may_not_write(
    demo_stack: DevStack, clients: Clients, backend: str, rpc: str, make: Callable[[], Message]
) -> None:
    refusal = await rpc_error(_call(clients, backend, rpc, make(), metadata(demo_stack, "bob")))
    assert (refusal.code, refusal.reason) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "PERMISSION_DENIED",
    )
    assert refusal.info.metadata["permission"] in ("tracker.write", "knowledge.write")
    assert demo_stack.calls_for(rpc)[-1].code == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize(("backend", "rpc", "make"), READS)
async def test_bob_may_read(
    demo_stack: DevStack, clients: Clients, backend: str, rpc: str, make: Callable[[], Message]
) -> None:
    await _call(clients, backend, rpc, make(), metadata(demo_stack, "bob"))


@pytest.mark.parametrize(("backend", "rpc", "make"), PROJECT_READS)
async def test_a_human_without_a_role_does_not_learn_that_the_project_exists(
    demo_stack: DevStack, clients: Clients, backend: str, rpc: str, make: Callable[[], Message]
) -> None:
    for md in (
        metadata(demo_stack, "carol"),  # globex's token
        metadata(demo_stack, "carol", organization_id="acme"),  # no role in acme
        metadata(demo_stack, "alice", organization_id="globex"),  # a role, but not in globex
    ):
        refusal = await rpc_error(_call(clients, backend, rpc, make(), md))
        assert (refusal.code, refusal.reason) == (grpc.StatusCode.NOT_FOUND, "PROJECT_NOT_FOUND")
    request = make()
    request.project_id = "no-such-project"  # type: ignore[attr-defined]
    refusal = await rpc_error(_call(clients, backend, rpc, request, metadata(demo_stack, "alice")))
    assert (refusal.code, refusal.reason) == (grpc.StatusCode.NOT_FOUND, "PROJECT_NOT_FOUND")


@pytest.mark.parametrize(("backend", "rpc", "make"), PROJECT_READS)
async def test_a_role_without_the_permission_is_permission_denied(
    demo_stack: DevStack, clients: Clients, backend: str, rpc: str, make: Callable[[], Message]
) -> None:
    # dave's role on demo grants nothing: he may know the project, not read it.
    refusal = await rpc_error(_call(clients, backend, rpc, make(), metadata(demo_stack, "dave")))
    assert refusal.code == grpc.StatusCode.PERMISSION_DENIED


async def test_knowledge_of_another_organization_is_invisible(
    demo_stack: DevStack, clients: Clients
) -> None:
    carol = metadata(demo_stack, "carol")
    refusal = await rpc_error(
        clients.knowledge.GetKnowledgeEntry(
            knowledge_pb2.GetKnowledgeEntryRequest(entry_id="ke-decimal-quantities"), metadata=carol
        )
    )
    assert (refusal.code, refusal.reason) == (grpc.StatusCode.NOT_FOUND, "ENTRY_NOT_FOUND")
    for query in ("", "decimal quantities", "on-call rota"):
        found = await clients.knowledge.SearchKnowledge(
            knowledge_pb2.SearchKnowledgeRequest(query=query), metadata=carol
        )
        assert {hit.entry.organization_id for hit in found.hits} <= {"globex"}
    own = await clients.knowledge.SearchKnowledge(
        knowledge_pb2.SearchKnowledgeRequest(query="on-call rota"), metadata=carol
    )
    assert [hit.entry.entry_id for hit in own.hits] == ["ke-globex-oncall"]
    alice = await clients.knowledge.SearchKnowledge(
        knowledge_pb2.SearchKnowledgeRequest(query="on-call rota"),
        metadata=metadata(demo_stack, "alice"),
    )
    assert "ke-globex-oncall" not in [hit.entry.entry_id for hit in alice.hits]
    # carol holding an acme token has no role there: no knowledge permission at all.
    refusal = await rpc_error(
        clients.knowledge.SearchKnowledge(
            knowledge_pb2.SearchKnowledgeRequest(query="decimal"),
            metadata=metadata(demo_stack, "carol", organization_id="acme"),
        )
    )
    assert refusal.code == grpc.StatusCode.PERMISSION_DENIED


async def test_get_project_reports_the_callers_permissions(
    demo_stack: DevStack, clients: Clients
) -> None:
    alice = await clients.tracker.GetProject(
        tracker_pb2.GetProjectRequest(project_id="demo"), metadata=metadata(demo_stack, "alice")
    )
    bob = await clients.tracker.GetProject(
        tracker_pb2.GetProjectRequest(project_id="demo"), metadata=metadata(demo_stack, "bob")
    )
    assert list(alice.permissions) == [
        "knowledge.read",
        "knowledge.write",
        "skill.read",
        "tracker.read",
        "tracker.write",
    ]
    assert list(bob.permissions) == ["knowledge.read", "skill.read", "tracker.read"]
    project = alice.project
    assert (project.organization_id, project.organization_name) == ("acme", "Acme Corp")
    assert project.settings["planner.skill"] == "demo-planning"
    assert project.settings["planner.model_credential"] == "demo-credential"
