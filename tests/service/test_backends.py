"""The tools end to end: ``ToolRunner`` -> ``GrpcToolBackends`` -> the real devstack.

docs/spec/turn-loop.md and docs/spec/authority.md (acting for the human, the
recorded actor, no policy, request ids) and docs/spec/turn-loop.md step 5 (every failure is an error
result). The devstack runs the built-in demo project (``devstack/demo/project.py``) on 127.0.0.1,
port 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from ballet_common.grpc.channels import make_channel
from ballet_common.tokens import KNOWLEDGE_AUDIENCE, SKILLS_AUDIENCE, TRACKER_AUDIENCE
from devstack.server import DevStack, DevStackConfig
from service.adapters.backends import GrpcToolBackends
from service.core.errors import NotFound, Unauthenticated, Unavailable
from service.core.ports import Acting, ToolCall
from service.core.tools import TOOLS, Tool, ToolContext, ToolOutcome, ToolRunner

SESSION = "sess-backends"
ACTOR = f"planner:{SESSION}"
TOOL_TIMEOUT_S = 5.0


@dataclass
class Planner:
    """The planner's side of the tests: a runner on real backend clients."""

    stack: DevStack
    channel: grpc.aio.Channel
    backends: GrpcToolBackends

    def acting(self, user: str = "alice", *, ttl_s: float = 3600.0) -> Acting:
        return Acting(
            human_id=user,
            organization_id="acme",
            token=self.stack.token(user, ttl_s=ttl_s),
            session_id=SESSION,
        )

    async def run(
        self,
        name: str,
        arguments: dict[str, Any],
        *,
        user: str = "alice",
        call_id: str = "",
        timeout_s: float = TOOL_TIMEOUT_S,
        acting: Acting | None = None,
    ) -> ToolOutcome:
        runner = ToolRunner(self.backends, timeout_s=timeout_s)
        context = ToolContext(
            acting=acting or self.acting(user), project_id="demo", reserve_write=lambda: True
        )
        call = ToolCall(
            call_id=call_id or f"call-{name}", name=name, arguments=json.dumps(arguments)
        )
        return await runner.run(call, context)

    async def ok(self, name: str, arguments: dict[str, Any], **kwargs: Any) -> Any:
        outcome = await self.run(name, arguments, **kwargs)
        assert not outcome.is_error, outcome.content
        return json.loads(outcome.content)


def error_reason(outcome: ToolOutcome) -> str:
    assert outcome.is_error, outcome.content
    reason: str = json.loads(outcome.content)["error"]["reason"]
    assert reason == outcome.error_reason
    return reason


def connect(stack: DevStack) -> tuple[grpc.aio.Channel, GrpcToolBackends]:
    # One channel for the three services: the devstack serves them on one address.
    channel = make_channel(stack.address, tls=None, insecure=False)
    backends = GrpcToolBackends(
        tracker=channel,
        skills=channel,
        knowledge=channel,
        tracker_credential=lambda: stack.planner_credential(TRACKER_AUDIENCE),
        skills_credential=lambda: stack.planner_credential(SKILLS_AUDIENCE),
        knowledge_credential=lambda: stack.planner_credential(KNOWLEDGE_AUDIENCE),
    )
    return channel, backends


@pytest.fixture(scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[DevStack]:
    started = await DevStack.start(
        DevStackConfig(data_dir=tmp_path_factory.mktemp("devstack"), address="127.0.0.1:0")
    )
    yield started
    await started.stop(None)


@pytest.fixture(scope="module")
async def planner(stack: DevStack) -> AsyncIterator[Planner]:
    channel, backends = connect(stack)
    yield Planner(stack, channel, backends)
    await channel.close()


@pytest.fixture(autouse=True)
def fresh_record(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test reads only its own calls, and leaves no fault behind."""
    if "stack" not in request.fixturenames:
        yield
        return
    stack: DevStack = request.getfixturevalue("stack")
    stack.call_log.clear()
    yield
    stack.faults.clear()


def assert_acted_for(stack: DevStack, human: str) -> None:
    records = stack.calls
    assert records, "the backends saw calls"
    for record in records:
        assert (record.human, record.actor) == (human, ACTOR), record


# --------------------------------------------------------------------------- every tool

#: One call of each tool that the demo project answers with a success (the ids are the
#: demo's, devstack/demo/project.py).
ONE_CALL_EACH: dict[str, dict[str, Any]] = {
    "list_items": {"kind": "epic"},
    "get_item": {"item_id": "PAN-9"},
    "list_runnable": {"page_size": 2},
    "search_project": {"query": "barcode"},
    "list_changesets": {},
    "propose_changeset": {
        "title": "Once",
        "operations": [{"add_dependency": {"item_id": "PAN-14", "blocked_by_id": "PAN-9"}}],
    },
    "list_skills": {},
    "read_skill": {"name": "demo-planning"},
    "search_knowledge": {"query": "decimal"},
    "get_knowledge": {"entry_id": "{entry_id}"},
    "create_knowledge": {"kind": "note", "title": "Once", "body": "Every tool, once."},
    "update_knowledge": {"entry_id": "{entry_id}", "version": 1, "status": "noted"},
}


@pytest.mark.parametrize("tool", TOOLS, ids=lambda tool: tool.name)
async def test_every_tool_once_on_the_devstack(planner: Planner, tool: Tool) -> None:
    """The gRPC adapter is a ``ToolBackends`` at run time too (mypy checks it statically):
    each tool succeeds against the real backends, and makes exactly the RPCs it declares,
    as the human, recorded as the planner."""
    arguments = dict(ONE_CALL_EACH[tool.name])
    if arguments.get("entry_id") == "{entry_id}":
        note = {"kind": "note", "title": f"For {tool.name}", "body": "x"}
        created = await planner.run("create_knowledge", note, call_id=f"call-note-{tool.name}")
        arguments["entry_id"] = created.knowledge_entry_id
        planner.stack.call_log.clear()
    outcome = await planner.run(tool.name, arguments, call_id=f"call-once-{tool.name}")
    assert not outcome.is_error, outcome.content
    json.loads(outcome.content)
    made = [f"{record.service.rsplit('.', 1)[1]}.{record.method}" for record in planner.stack.calls]
    assert made == list(tool.rpcs)
    assert_acted_for(planner.stack, "alice")
    if tool.is_write:
        (record,) = planner.stack.calls
        assert record.request_id == f"call-once-{tool.name}", "the call id is the request id"


# --------------------------------------------------------------------------- reads


async def test_list_items_filters_and_pages(planner: Planner) -> None:
    epics = await planner.ok("list_items", {"kind": "epic"})
    assert [item["item_id"] for item in epics["items"]] == ["PAN-3", "PAN-4", "PAN-5", "PAN-6"]
    assert epics["total_size"] == 4
    assert "next_page_token" not in epics
    first = epics["items"][0]
    assert first == {
        "item_id": "PAN-3",
        "kind": "epic",
        "title": "Accounts and households",
        "state": "in_progress",
        "priority": 1,
        "milestone_id": "PAN-1",
    }
    assert "description" not in first, "descriptions only in get_item"

    page = await planner.ok("list_items", {"epic_id": "PAN-4", "page_size": 2})
    assert len(page["items"]) == 2 and page["next_page_token"]
    rest = await planner.ok(
        "list_items", {"epic_id": "PAN-4", "page_size": 10, "page_token": page["next_page_token"]}
    )
    ids = [item["item_id"] for item in page["items"] + rest["items"]]
    assert sorted(ids) == ["PAN-10", "PAN-11", "PAN-12", "PAN-13", "PAN-14"]
    assert all(item["epic_id"] == "PAN-4" for item in page["items"] + rest["items"])

    closed = await planner.ok("list_items", {"state": "closed", "milestone_id": "PAN-1"})
    assert {item["item_id"] for item in closed["items"]} == {"PAN-7", "PAN-10"}
    assert_acted_for(planner.stack, "alice")


async def test_get_item_has_the_full_text_policy_and_dependencies(planner: Planner) -> None:
    item = (await planner.ok("get_item", {"item_id": "PAN-19"}))["item"]
    assert item["kind"] == "ticket" and item["ticket_type"] == "feature"
    assert (item["epic_id"], item["milestone_id"]) == ("PAN-6", "PAN-2")
    assert sorted(item["blocked_by_ids"]) == ["PAN-18", "PAN-8"]
    assert item["blocks_ids"] == []
    assert item["description"].startswith("One notification a day")
    assert "notification" in item["acceptance_criteria"]
    assert "policy" not in item

    with_policy = (await planner.ok("get_item", {"item_id": "PAN-13"}))["item"]
    assert with_policy["policy"] == {"mode": "auto", "settings": {"agent": "chore-bot"}}
    assert_acted_for(planner.stack, "alice")


async def test_list_runnable(planner: Planner) -> None:
    runnable = await planner.ok("list_runnable", {})
    assert len(runnable["items"]) == runnable["total_size"] == 5
    assert all(item["kind"] == "ticket" and item["state"] == "open" for item in runnable["items"])
    assert "PAN-9" in {item["item_id"] for item in runnable["items"]}
    assert_acted_for(planner.stack, "alice")


async def test_search_project_finds_items_and_skills(planner: Planner) -> None:
    found = await planner.ok("search_project", {"query": "barcode scan", "limit": 5})
    assert found["items_searched"] and found["skills_searched"]
    assert found["results"][0]["item"]["item_id"] == "PAN-12"
    assert all({"score", "snippet"} <= set(hit) for hit in found["results"])

    skills = await planner.ok("search_project", {"query": "release notes"})
    names = [hit["skill"]["name"] for hit in skills["results"] if "skill" in hit]
    assert "release-notes" in names
    assert_acted_for(planner.stack, "alice")


async def test_skills_resolve_the_pinned_version(planner: Planner) -> None:
    listed = {skill["name"]: skill for skill in (await planner.ok("list_skills", {}))["skills"]}
    planning = listed["demo-planning"]
    assert (planning["version"], planning["pinned"], planning["latest_version"]) == (
        "1.0.0",
        True,
        "1.1.0",
    )
    assert planning["scope"] == "project"
    assert listed["release-notes"]["scope"] == "project", "the project's hides the org's"
    assert listed["ticket-writing"]["scope"] == "organization"

    read = await planner.ok("read_skill", {"name": "demo-planning"})
    assert read["skill"]["version"] == "1.0.0"
    assert "(1.0.0)" in read["content"]
    assert_acted_for(planner.stack, "alice")


async def test_knowledge_search_and_get(planner: Planner) -> None:
    found = await planner.ok("search_knowledge", {"query": "decimal quantities"})
    hit = found["hits"][0]
    assert hit["title"] == "Store quantities as decimal strings"
    assert (hit["kind"], hit["status"]) == ("decision", "accepted")
    assert "body" not in hit
    decisions = await planner.ok("search_knowledge", {"query": "", "kind": "debt"})
    assert {h["kind"] for h in decisions["hits"]} == {"debt"}

    entry = (await planner.ok("get_knowledge", {"entry_id": hit["entry_id"]}))["entry"]
    assert entry["body"].startswith("## Context")
    assert entry["item_ids"] == ["PAN-10", "PAN-17"]
    assert entry["version"] >= 1
    assert_acted_for(planner.stack, "alice")


# --------------------------------------------------------------------------- writes


async def test_propose_changeset_links_created_items_by_ref(planner: Planner) -> None:
    arguments = {
        "title": "Plan the recipes feature",
        "description": "Households asked for recipes that use what is in the pantry.",
        "operations": [
            {"create_item": {"ref": "recipes", "kind": "epic", "title": "Recipes",
                             "milestone_id": "PAN-2"}},
            {"create_item": {"ref": "suggest", "kind": "ticket", "title": "Suggest recipes",
                             "epic_id": "recipes", "priority": 1, "ticket_type": "feature",
                             "acceptance_criteria": "- Three suggestions"}},
            {"add_dependency": {"item_id": "suggest", "blocked_by_id": "PAN-11"}},
            {"update_item": {"item_id": "PAN-12", "priority": 4, "state": "blocked"}},
            {"remove_dependency": {"item_id": "PAN-14", "blocked_by_id": "PAN-11"}},
        ],
    }  # fmt: skip
    outcome = await planner.run("propose_changeset", arguments, call_id="call-propose-1")
    assert not outcome.is_error, outcome.content
    changeset = json.loads(outcome.content)["changeset"]
    assert changeset["changeset_id"] == outcome.changeset_id != ""
    assert changeset["status"] == "proposed"
    assert (changeset["author_id"], changeset["recorded_by"]) == ("alice", ACTOR)
    assert changeset["operations"][1]["create_item"]["epic_id"] == "recipes"
    assert changeset["operations"][3] == {
        "update_item": {"item_id": "PAN-12", "priority": 4, "state": "blocked"}
    }
    assert changeset["operations"][4] == {
        "remove_dependency": {"item_id": "PAN-14", "blocked_by_id": "PAN-11"}
    }
    (record,) = planner.stack.calls_for("ProposeChangeset")
    assert record.request_id == "call-propose-1", "the tool call id is the request id"

    listed = await planner.ok("list_changesets", {"status": "proposed"})
    mine = [c for c in listed["changesets"] if c["changeset_id"] == outcome.changeset_id]
    assert mine and mine[0]["operations"] == changeset["operations"]
    assert_acted_for(planner.stack, "alice")


async def test_the_same_request_id_twice_writes_once(planner: Planner) -> None:
    arguments = {
        "title": "Retry me",
        "operations": [{"create_item": {"kind": "ticket", "title": "Idempotent"}}],
    }
    first = await planner.run("propose_changeset", arguments, call_id="call-retry")
    second = await planner.run("propose_changeset", arguments, call_id="call-retry")
    assert not first.is_error and not second.is_error
    assert first.changeset_id == second.changeset_id
    assert planner.stack.writes["call-retry"] == 1

    note = {"kind": "note", "title": "Once", "body": "written once"}
    created = [await planner.run("create_knowledge", note, call_id="call-note") for _ in range(2)]
    assert created[0].knowledge_entry_id == created[1].knowledge_entry_id != ""
    assert planner.stack.writes["call-note"] == 1


async def test_knowledge_written_is_the_humans_and_versions_are_checked(
    planner: Planner,
) -> None:
    created = await planner.run(
        "create_knowledge",
        {"kind": "decision", "title": "Offline first", "body": "Lists work offline.",
         "status": "proposed", "item_ids": ["PAN-16"]},
        call_id="call-create-decision",
    )  # fmt: skip
    assert not created.is_error, created.content
    entry = json.loads(created.content)["entry"]
    assert (entry["author_id"], entry["recorded_by"]) == ("alice", ACTOR)
    assert entry["version"] == created.knowledge_version == 1
    assert entry["project_ids"] == ["demo"]
    assert entry["item_ids"] == ["PAN-16"]
    entry_id = created.knowledge_entry_id

    updated = await planner.run(
        "update_knowledge",
        {"entry_id": entry_id, "version": 1, "status": "accepted", "item_ids": []},
        call_id="call-update-1",
    )
    assert not updated.is_error, updated.content
    after = json.loads(updated.content)["entry"]
    assert (after["version"], after["status"], after["item_ids"]) == (2, "accepted", [])
    assert (updated.knowledge_entry_id, updated.knowledge_version) == (entry_id, 2)
    assert after["author_id"] == "alice"

    stale = await planner.run(
        "update_knowledge",
        {"entry_id": entry_id, "version": 1, "body": "an edit from an old read"},
        call_id="call-update-stale",
    )
    assert error_reason(stale) == "STALE_VERSION"
    reread = await planner.ok("get_knowledge", {"entry_id": entry_id})
    assert reread["entry"]["version"] == 2
    assert reread["entry"]["body"] == "Lists work offline."
    assert_acted_for(planner.stack, "alice")


async def test_a_policy_never_reaches_the_tracker(planner: Planner) -> None:
    outcome = await planner.run(
        "propose_changeset",
        {"title": "Automate it", "operations": [
            {"update_item": {"item_id": "PAN-14", "policy": {"mode": "auto"}}}]},
        call_id="call-policy",
    )  # fmt: skip
    assert error_reason(outcome) == "POLICY_CHANGE_NOT_ALLOWED"
    assert planner.stack.call_log.started("ProposeChangeset") == 0
    assert planner.stack.calls_for("ProposeChangeset") == []
    assert "call-policy" not in planner.stack.writes


# --------------------------------------------------------------------------- failures


async def test_bob_may_not_propose(planner: Planner) -> None:
    outcome = await planner.run(
        "propose_changeset",
        {"title": "Bob's idea", "operations": [{"create_item": {"kind": "ticket", "title": "x"}}]},
        user="bob",
        call_id="call-bob",
    )
    assert error_reason(outcome) == "PERMISSION_DENIED"
    assert "call-bob" not in planner.stack.writes
    (record,) = planner.stack.calls_for("ProposeChangeset")
    assert (record.human, record.actor, record.code) == (
        "bob",
        ACTOR,
        grpc.StatusCode.PERMISSION_DENIED,
    )
    # Reading is what bob may do, and the planner does it for him.
    assert not (await planner.run("get_item", {"item_id": "PAN-9"}, user="bob")).is_error


async def test_unknown_ids_are_not_found(planner: Planner) -> None:
    assert error_reason(await planner.run("get_item", {"item_id": "PAN-999"})) == "NOT_FOUND"
    assert error_reason(await planner.run("read_skill", {"name": "no-such-skill"})) == "NOT_FOUND"
    assert error_reason(await planner.run("get_knowledge", {"entry_id": "nope"})) == "NOT_FOUND"


async def test_a_bad_page_token_is_invalid_arguments(planner: Planner) -> None:
    outcome = await planner.run("list_items", {"page_token": "forged"})
    assert error_reason(outcome) == "INVALID_ARGUMENTS"


async def test_an_expired_token_is_credential_expired(planner: Planner) -> None:
    acting = planner.acting(ttl_s=-3600)
    outcome = await planner.run("list_skills", {}, acting=acting)
    assert error_reason(outcome) == "CREDENTIAL_EXPIRED"
    with pytest.raises(Unauthenticated) as raised:
        await planner.backends.get_project(acting, "demo", TOOL_TIMEOUT_S)
    assert raised.value.reason == "TOKEN_EXPIRED"


async def test_a_slow_backend_is_deadline_exceeded(planner: Planner) -> None:
    # Parked until the fixture clears the fault: the tool deadline is what ends the call.
    planner.stack.faults.set(method="GetItem", delay_s=math.inf)
    outcome = await planner.run("get_item", {"item_id": "PAN-9"}, timeout_s=0.2)
    assert error_reason(outcome) == "DEADLINE_EXCEEDED"
    assert planner.stack.call_log.started("GetItem") == 1


async def test_a_stopped_backend_is_unavailable(tmp_path: Path) -> None:
    stack = await DevStack.start(DevStackConfig(data_dir=tmp_path, address="127.0.0.1:0"))
    channel, backends = connect(stack)
    try:
        planner = Planner(stack, channel, backends)
        acting = planner.acting()
        assert not (await planner.run("list_skills", {})).is_error
        await stack.stop(None)
        outcome = await planner.run("list_items", {}, acting=acting)
        assert error_reason(outcome) == "BACKEND_UNAVAILABLE"
        with pytest.raises(Unavailable) as raised:
            await backends.get_project(acting, "demo", TOOL_TIMEOUT_S)
        assert raised.value.reason == "DEPENDENCY_UNAVAILABLE"
    finally:
        await channel.close()
        await stack.stop(None)


# --------------------------------------------------------------------------- the ports


async def test_get_project_gives_the_planner_settings(planner: Planner) -> None:
    project = await planner.backends.get_project(planner.acting(), "demo", TOOL_TIMEOUT_S)
    assert (project.project_id, project.organization_id) == ("demo", "acme")
    assert project.name and project.organization_name
    assert (project.planner_skill, project.model_credential) == (
        "demo-planning",
        "demo-credential",
    )
    assert {"tracker.read", "tracker.write", "knowledge.write"} <= project.permissions
    bob = await planner.backends.get_project(planner.acting("bob"), "demo", TOOL_TIMEOUT_S)
    assert "tracker.write" not in bob.permissions and "tracker.read" in bob.permissions
    humans = [(record.human, record.actor) for record in planner.stack.calls_for("GetProject")]
    assert humans == [("alice", ACTOR), ("bob", ACTOR)]


@pytest.mark.parametrize("project_id", ["no-such-project", "globex-ops"])
async def test_a_project_the_human_cannot_read_is_not_found(
    planner: Planner, project_id: str
) -> None:
    with pytest.raises(NotFound) as raised:
        await planner.backends.get_project(planner.acting(), project_id, TOOL_TIMEOUT_S)
    assert raised.value.reason == "PROJECT_NOT_FOUND"


async def test_read_skill_applies_the_pin(planner: Planner) -> None:
    document = await planner.backends.read_skill(
        planner.acting(), "demo", "demo-planning", TOOL_TIMEOUT_S
    )
    assert (document.name, document.version) == ("demo-planning", "1.0.0")
    assert "(1.0.0)" in document.content
    with pytest.raises(NotFound):
        await planner.backends.read_skill(planner.acting(), "demo", "missing", TOOL_TIMEOUT_S)
    assert_acted_for(planner.stack, "alice")


async def test_without_the_planner_credential_the_actor_is_not_honoured(stack: DevStack) -> None:
    # The service credential is what makes a backend believe x-ballet-actor
    # (docs/spec/authority.md); an empty one sends no header, as with an mTLS identity the devstack
    # does not check.
    channel = make_channel(stack.address, tls=None, insecure=False)
    try:
        backends = GrpcToolBackends(
            tracker=channel,
            skills=channel,
            knowledge=channel,
            tracker_credential=lambda: "",
            skills_credential=lambda: "",
            knowledge_credential=lambda: "",
        )
        planner = Planner(stack, channel, backends)
        assert not (await planner.run("list_skills", {})).is_error
    finally:
        await channel.close()
    (record,) = stack.calls_for("ListSkills")
    assert (record.human, record.actor, record.actor_header) == ("alice", "", ACTOR)
