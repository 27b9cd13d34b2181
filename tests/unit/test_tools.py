"""The twelve tools and the runner's checks (docs/spec/turn-loop.md and docs/spec/authority.md).

The backends are the hand-written in-memory ``FakeBackends`` (tests/unit/fakes.py), which
records every call, so each test can show that a refused call never reached a backend.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from service.core import tools
from service.core.backend_types import (
    ChangesetProposal,
    CreateItem,
    DependencyChange,
    Item,
    ItemKind,
    ItemPage,
    ItemState,
    KnowledgeEntry,
    KnowledgeKind,
    ProjectHit,
    ProjectSearchResult,
    Skill,
    SkillContent,
    SkillScope,
    UpdateItem,
)
from service.core.errors import ToolFailure
from service.core.ports import Acting, ToolCall
from service.core.tools import (
    MAX_RESULT_BYTES,
    TOOL_SCHEMA_VERSION,
    TOOLS,
    TOOLS_BY_NAME,
    ToolContext,
    ToolOutcome,
    ToolRunner,
    cut_to_fit,
    declarations,
)
from tests.unit.fakes import FakeBackends

ACTING = Acting(human_id="alice", organization_id="acme", token="tok", session_id="s1")

#: Bump TOOL_SCHEMA_VERSION and record the new fingerprint when the tools change.
FINGERPRINTS = {
    "tools-2026-11-1": "54f0867bcd7895d2b84c2541d960c9e5479aa0899c9f2d8d4045cb038b2c9be8",
    # update_knowledge's version got its int64 maximum.
    "tools-2026-12-1": "d33f11eeb47aa2403c80c5b54f3d1a2bd9ad581adc2b3c37da0cb4605550e01c",
    # Lean declarations: no result shapes, no validation bounds (decision 0295).
    "tools-2026-12-2": "5b0ba0a2528e91e41c7579692c68cf69d5f4aa33dde9af422748ff62fc971707",
}


def hang(backends: FakeBackends, *names: str) -> None:
    """Make the tools ``names`` wait forever (until cancelled)."""
    for name in names:
        backends.block[name] = asyncio.Event()


@dataclass
class WriteCounter:
    """The turn loop's write counter, as the runner sees it."""

    left: int = 5
    asked: int = 0

    def reserve(self) -> bool:
        self.asked += 1
        if self.left <= 0:
            return False
        self.left -= 1
        return True


@dataclass
class Harness:
    backends: FakeBackends = field(default_factory=FakeBackends)
    writes: WriteCounter = field(default_factory=WriteCounter)
    runner: ToolRunner | None = None

    def __post_init__(self) -> None:
        self.runner = ToolRunner(self.backends, timeout_s=5.0)

    async def run(
        self, name: str, arguments: Any, *, raw: bool = False, timeout_s: float | None = None
    ) -> ToolOutcome:
        assert self.runner is not None
        text = arguments if raw else json.dumps(arguments)
        context = ToolContext(
            acting=ACTING,
            project_id="demo",
            reserve_write=self.writes.reserve,
            timeout_s=timeout_s,
        )
        return await self.runner.run(ToolCall(call_id="call-1", name=name, arguments=text), context)


@pytest.fixture
def harness() -> Harness:
    return Harness()


def error_of(outcome: ToolOutcome) -> dict[str, str]:
    assert outcome.is_error
    document = json.loads(outcome.content)
    assert set(document) == {"error"}
    assert set(document["error"]) == {"reason", "message"}
    assert document["error"]["reason"] == outcome.error_reason
    error: dict[str, str] = document["error"]
    return error


VALID_CHANGESET: dict[str, Any] = {
    "title": "Split the auth epic",
    "operations": [
        {"create_item": {"ref": "e", "kind": "epic", "title": "Auth"}},
        {"create_item": {"kind": "ticket", "title": "Login", "epic_id": "e", "priority": 1}},
        {"update_item": {"item_id": "T-1", "state": "closed"}},
        {"add_dependency": {"item_id": "T-2", "blocked_by_id": "e"}},
        {"remove_dependency": {"item_id": "T-3", "blocked_by_id": "T-4"}},
    ],
}

#: One valid call per tool.
VALID_ARGUMENTS: dict[str, dict[str, Any]] = {
    "list_items": {"kind": "epic", "state": "open", "page_size": 20},
    "get_item": {"item_id": "T-1"},
    "list_runnable": {},
    "search_project": {"query": "login", "limit": 5},
    "list_changesets": {"status": "proposed"},
    "propose_changeset": VALID_CHANGESET,
    "list_skills": {},
    "read_skill": {"name": "planning"},
    "search_knowledge": {"query": "database", "kind": "decision"},
    "get_knowledge": {"entry_id": "K-1"},
    "create_knowledge": {"kind": "note", "title": "t", "body": "b", "item_ids": ["T-1"]},
    "update_knowledge": {"entry_id": "K-1", "version": 2, "body": "new"},
}


# --------------------------------------------------------------------------- the specs


def objects(schema: Any, path: str = "$") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object schema inside ``schema``, with where it is."""
    if isinstance(schema, dict):
        if schema.get("type") == "object" or "properties" in schema:
            yield path, schema
        for key, value in schema.items():
            yield from objects(value, f"{path}/{key}")
    elif isinstance(schema, list):
        for index, value in enumerate(schema):
            yield from objects(value, f"{path}/{index}")


def property_names(schema: Any) -> Iterator[str]:
    for _, node in objects(schema):
        yield from node.get("properties", {})


def test_the_twelve_tools_of_the_seed_with_their_needs() -> None:
    needs = {spec.name: (spec.permissions, spec.is_write) for spec in TOOLS}
    assert needs == {
        "list_items": (("tracker.read",), False),
        "get_item": (("tracker.read",), False),
        "list_runnable": (("tracker.read",), False),
        "search_project": (("tracker.read", "skill.read"), False),
        "list_changesets": (("tracker.read",), False),
        "propose_changeset": (("tracker.write",), True),
        "list_skills": (("skill.read",), False),
        "read_skill": (("skill.read",), False),
        "search_knowledge": (("knowledge.read",), False),
        "get_knowledge": (("knowledge.read",), False),
        "create_knowledge": (("knowledge.write",), True),
        "update_knowledge": (("knowledge.write",), True),
    }
    assert {"propose_changeset", "create_knowledge", "update_knowledge"} == tools.WRITE_TOOLS


@pytest.mark.parametrize("spec", TOOLS, ids=lambda spec: spec.name)
def test_every_schema_is_draft_2020_12_and_closed_at_every_level(spec: tools.Tool) -> None:
    Draft202012Validator.check_schema(spec.schema)
    found = list(objects(spec.schema))
    assert found, "the arguments are an object"
    for path, node in found:
        assert node.get("additionalProperties") is False, f"{spec.name} {path}"
    assert spec.schema["type"] == "object"


@pytest.mark.parametrize("spec", TOOLS, ids=lambda spec: spec.name)
def test_no_schema_takes_a_project_id_or_a_policy(spec: tools.Tool) -> None:
    names = set(property_names(spec.schema))
    assert not {name for name in names if "project" in name}
    assert not {name for name in names if "policy" in name}


@pytest.mark.parametrize("spec", TOOLS, ids=lambda spec: spec.name)
def test_descriptions_are_lean(spec: tools.Tool) -> None:
    # Decision 0295: no result shapes, nothing the instructions say once for all tools.
    assert "Returns" not in spec.description
    assert "next_page_token" not in spec.description and "truncated" not in spec.description
    assert "not instructions" not in spec.description
    if spec.name == "propose_changeset":
        assert "human" in spec.description and "approv" in spec.description


def test_the_valid_examples_validate() -> None:
    assert set(VALID_ARGUMENTS) == set(TOOLS_BY_NAME)
    for name, arguments in VALID_ARGUMENTS.items():
        tools.validate_arguments(name, arguments)


def test_declarations_carry_the_schemas_as_json() -> None:
    offered = declarations()
    assert [d.name for d in offered] == [spec.name for spec in TOOLS]
    for declaration, spec in zip(offered, TOOLS, strict=True):
        assert json.loads(declaration.parameters_json_schema) == tools.declared_schema(spec.schema)
        assert declaration.description == spec.description


@pytest.mark.parametrize("spec", TOOLS, ids=lambda spec: spec.name)
def test_the_declaration_is_the_schema_without_its_validation_bounds(spec: tools.Tool) -> None:
    declared = tools.declared_schema(spec.schema)
    text = json.dumps(declared)
    assert not [word for word in tools.VALIDATION_ONLY if f'"{word}"' in text]
    Draft202012Validator.check_schema(declared)
    # The same structure: every property, type, enum and required list is still there.
    assert list(property_names(declared)) == list(property_names(spec.schema))
    for (path, node), (_, full) in zip(objects(declared), objects(spec.schema), strict=True):
        assert node.get("required") == full.get("required"), path
        assert node["additionalProperties"] is False, path
    # What the model may send by the declaration, validation still checks by the bounds.
    assert spec.schema != declared or spec.name == "list_skills"


def test_a_bound_left_out_of_the_declaration_is_still_enforced() -> None:
    with pytest.raises(ToolFailure) as refused:
        tools.validate_arguments("list_items", {"page_size": 10_000})
    assert refused.value.reason == "INVALID_ARGUMENTS" and "page_size" in str(refused.value)


def test_the_schema_version_changes_with_the_tools() -> None:
    text = json.dumps([[d.name, d.description, d.parameters_json_schema] for d in declarations()])
    fingerprint = hashlib.sha256(text.encode()).hexdigest()
    assert FINGERPRINTS.get(TOOL_SCHEMA_VERSION) == fingerprint, (
        "the tools changed: bump TOOL_SCHEMA_VERSION and record "
        f"{TOOL_SCHEMA_VERSION!r}: {fingerprint!r} here"
    )


# --------------------------------------------------------------------------- the checks


@pytest.mark.parametrize(
    "text", ["{not json", "", '{"item_id": NaN}', "[1, 2]", '"T-1"', "3", "null", "true"]
)
async def test_arguments_that_are_not_a_json_object(harness: Harness, text: str) -> None:
    outcome = await harness.run("get_item", text, raw=True)
    assert error_of(outcome)["reason"] == "INVALID_ARGUMENTS"
    assert harness.backends.calls == []


async def test_an_unknown_tool(harness: Harness) -> None:
    outcome = await harness.run("apply_changeset", {"changeset_id": "C-1"})
    error = error_of(outcome)
    assert error["reason"] == "UNKNOWN_TOOL"
    assert "propose_changeset" in error["message"]
    assert harness.backends.calls == []


@pytest.mark.parametrize(
    ("name", "arguments", "path"),
    [
        ("get_item", {}, "$"),
        ("get_item", {"item_id": 7}, "$.item_id"),
        ("list_items", {"kind": "story"}, "$.kind"),
        ("list_items", {"page_size": 0}, "$.page_size"),
        ("update_knowledge", {"entry_id": "K-1", "version": "2", "body": "x"}, "$.version"),
        ("update_knowledge", {"entry_id": "K-1", "version": 2}, "$"),
        ("propose_changeset", {"title": "t", "operations": []}, "$.operations"),
        (
            "propose_changeset",
            {"title": "t", "operations": [{"create_item": {"kind": "epic"}}]},
            "$.operations[0].create_item",
        ),
        (
            "propose_changeset",
            {"title": "t", "operations": [{"delete_item": {"item_id": "T-1"}}]},
            "$.operations[0]",
        ),
    ],
)
async def test_a_schema_violation_names_the_path(
    harness: Harness, name: str, arguments: dict[str, Any], path: str
) -> None:
    outcome = await harness.run(name, arguments)
    error = error_of(outcome)
    assert error["reason"] == "INVALID_ARGUMENTS"
    assert error["message"].startswith(f"{path}: ")
    assert harness.backends.calls == []
    assert harness.writes.asked == 0, "a refused write does not use the write budget"


@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        ("list_skills", {"verbose": True}),
        ("get_item", {"item_id": "T-1", "project_id": "other"}),
        ("create_knowledge", {"kind": "note", "title": "t", "body": "b", "author": "bob"}),
        (
            "propose_changeset",
            {"title": "t", "operations": [{"update_item": {"item_id": "T-1", "owner": "x"}}]},
        ),
    ],
)
async def test_unknown_fields_are_rejected(
    harness: Harness, name: str, arguments: dict[str, Any]
) -> None:
    outcome = await harness.run(name, arguments)
    error = error_of(outcome)
    assert error["reason"] == "INVALID_ARGUMENTS"
    assert "was unexpected" in error["message"]
    assert harness.backends.calls == []


POLICY = {"mode": "auto"}


@pytest.mark.parametrize(
    "operations",
    [
        [{"create_item": {"kind": "ticket", "title": "t", "policy": POLICY}}],
        [{"update_item": {"item_id": "T-1", "policy": POLICY}}],
        [{"update_item": {"item_id": "T-1", "execution_policy": POLICY}}],
        [{"policy": POLICY}],
        [{"set_policy": {"item_id": "T-1", "mode": "auto"}}],
        [{"update_item": {"item_id": "T-1", "title": "x", "extra": [{"policy": None}]}}],
        # The policy wins over every other problem, even a malformed operation.
        [{"create_item": {"policy": POLICY}}, "not an operation"],
        # ... and an innocent first operation does not hide it.
        [
            {"update_item": {"item_id": "T-1", "title": "x"}},
            {"update_item": {"item_id": "T-2", "policy": POLICY}},
        ],
    ],
)
async def test_a_policy_anywhere_is_refused_before_any_other_check(
    harness: Harness, operations: list[Any]
) -> None:
    outcome = await harness.run("propose_changeset", {"title": "t", "operations": operations})
    assert error_of(outcome)["reason"] == "POLICY_CHANGE_NOT_ALLOWED"
    assert harness.backends.calls == []
    assert harness.writes.asked == 0


async def test_the_write_cap(harness: Harness) -> None:
    harness.writes.left = 2
    for _ in range(2):
        outcome = await harness.run("create_knowledge", VALID_ARGUMENTS["create_knowledge"])
        assert not outcome.is_error
    refused = await harness.run("propose_changeset", VALID_CHANGESET)
    assert error_of(refused)["reason"] == "WRITE_LIMIT_REACHED"
    assert [call.tool for call in harness.backends.calls] == ["create_knowledge"] * 2
    # Reads never ask for the write budget, and still run.
    assert not (await harness.run("get_item", {"item_id": "T-1"})).is_error
    assert harness.writes.asked == 3


async def test_a_valid_call_reaches_the_backend_as_the_human_in_the_project(
    harness: Harness,
) -> None:
    outcome = await harness.run("propose_changeset", VALID_CHANGESET, timeout_s=2.0)
    assert not outcome.is_error
    assert json.loads(outcome.content)["changeset"]["changeset_id"] == "cs-call-1"
    assert outcome.changeset_id == "cs-call-1"
    (call,) = harness.backends.calls
    assert call.tool == "propose_changeset"
    assert call.request == ChangesetProposal(
        request_id="call-1",
        project_id="demo",
        title="Split the auth epic",
        description="",
        operations=(
            CreateItem(ItemKind.EPIC, "Auth", priority=2, ref="e"),
            CreateItem(ItemKind.TICKET, "Login", priority=1, epic_id="e"),
            UpdateItem("T-1", state=ItemState.CLOSED),
            DependencyChange("T-2", "e"),
            DependencyChange("T-3", "T-4", remove=True),
        ),
    )
    assert call.project_id == "demo"
    assert call.acting == ACTING
    assert call.request_id == "call-1", "the planner's call id is the write's request id"
    assert call.timeout_s == 2.0, "the turn's remaining budget caps the tool deadline"


async def test_a_knowledge_write_reports_the_entry_and_version(harness: Harness) -> None:
    harness.backends.answers["update_knowledge"] = KnowledgeEntry(
        "K-1", KnowledgeKind.NOTE, "t", "", 3, "alice", "planner:s1"
    )
    outcome = await harness.run("update_knowledge", VALID_ARGUMENTS["update_knowledge"])
    assert (outcome.knowledge_entry_id, outcome.knowledge_version) == ("K-1", 3)
    assert outcome.changeset_id == ""


@pytest.mark.parametrize(
    "reason",
    [
        "PERMISSION_DENIED",
        "NOT_FOUND",
        "STALE_VERSION",
        "BACKEND_UNAVAILABLE",
        "CREDENTIAL_EXPIRED",
    ],
)
async def test_a_backend_failure_is_an_error_result(harness: Harness, reason: str) -> None:
    harness.backends.failures["get_item"] = ToolFailure(reason, "the backend says no")
    outcome = await harness.run("get_item", {"item_id": "T-1"})
    assert error_of(outcome) == {"reason": reason, "message": "the backend says no"}


async def test_a_bug_in_a_backend_is_an_error_result_not_an_exception(harness: Harness) -> None:
    harness.backends.answers["get_item"] = RuntimeError("boom")
    outcome = await harness.run("get_item", {"item_id": "T-1"})
    assert error_of(outcome)["reason"] == "BACKEND_ERROR"


async def test_an_unserializable_result_is_an_error_result(harness: Harness) -> None:
    # The adapter keeps scores finite; a NaN that got through anyway is not sent as
    # "NaN", which is not JSON.
    nan = ProjectHit(math.nan, "s", item=Item("T-1", ItemKind.TICKET, "t", ItemState.OPEN, 1))
    harness.backends.answers["search_project"] = ProjectSearchResult((nan,), True, True)
    outcome = await harness.run("search_project", {"query": "x"})
    assert error_of(outcome)["reason"] == "BACKEND_ERROR"


async def test_a_backend_that_never_answers_gets_deadline_exceeded() -> None:
    backends = FakeBackends()
    hang(backends, "get_item", "create_knowledge")
    runner = ToolRunner(backends, timeout_s=0.02)
    context = ToolContext(acting=ACTING, project_id="demo", reserve_write=lambda: True)
    read = await runner.run(ToolCall("c1", "get_item", '{"item_id": "T-1"}'), context)
    assert error_of(read)["reason"] == "DEADLINE_EXCEEDED"
    write = await runner.run(
        ToolCall("c2", "create_knowledge", json.dumps(VALID_ARGUMENTS["create_knowledge"])),
        context,
    )
    error = error_of(write)
    assert error["reason"] == "DEADLINE_EXCEEDED"
    assert "may or may not" in error["message"], "a timed-out write's outcome is unknown"


async def test_no_time_left_in_the_turn_means_no_backend_call(harness: Harness) -> None:
    outcome = await harness.run("get_item", {"item_id": "T-1"}, timeout_s=0.0)
    assert error_of(outcome)["reason"] == "DEADLINE_EXCEEDED"
    assert harness.backends.calls == []


async def test_cancellation_reaches_the_caller() -> None:
    backends = FakeBackends()
    hang(backends, "list_skills")
    runner = ToolRunner(backends, timeout_s=60)
    context = ToolContext(acting=ACTING, project_id="demo", reserve_write=lambda: True)
    task = asyncio.create_task(runner.run(ToolCall("c1", "list_skills", "{}"), context))
    await backends.reached("list_skills").wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_error_results_have_one_shape() -> None:
    outcome = tools.error_result("TOO_MANY_CALLS", "x" * 5000)
    error = error_of(outcome)
    assert error["reason"] == "TOO_MANY_CALLS"
    assert len(error["message"]) <= 1000


# --------------------------------------------------------------------------- the cut


def compact_items(count: int) -> dict[str, Any]:
    return {
        "items": [
            {
                "item_id": f"T-{i}",
                "kind": "ticket",
                "title": f"Ticket {i} " + "é" * 80,
                "state": "open",
                "priority": i % 5,
            }
            for i in range(count)
        ],
        "total_size": count,
        "next_page_token": "page-2",
    }


async def test_a_large_list_result_keeps_whole_items(harness: Harness) -> None:
    output = compact_items(400)
    harness.backends.answers["list_items"] = ItemPage(
        tuple(
            Item(i["item_id"], ItemKind.TICKET, i["title"], ItemState.OPEN, i["priority"])
            for i in output["items"]
        ),
        next_page_token="page-2",
        total_size=400,
    )
    outcome = await harness.run("list_items", {})
    assert not outcome.is_error
    assert len(outcome.content.encode()) <= MAX_RESULT_BYTES
    document = json.loads(outcome.content)
    full = json.dumps(output, ensure_ascii=False, separators=(",", ":"))
    assert document["truncated"] is True
    assert document["original_bytes"] == len(full.encode())
    kept = document["content"]["items"]
    assert 0 < len(kept) < 400
    assert kept == output["items"][: len(kept)], "whole items, in order, unchanged"
    assert document["content"]["total_size"] == 400
    assert "next_page_token" not in document["content"], "it would skip the cut items"
    # As many as fit: one more would not.
    one_more = {
        "truncated": True,
        "original_bytes": document["original_bytes"],
        "content": {"items": output["items"][: len(kept) + 1], "total_size": 400},
    }
    too_big = json.dumps(one_more, ensure_ascii=False, separators=(",", ":"))
    assert len(too_big.encode()) > MAX_RESULT_BYTES


async def test_a_long_string_result_keeps_as_many_characters_as_fit(harness: Harness) -> None:
    content = "# Skill\n" + 'ü"\n' * 20_000
    skill = Skill("planning", "", SkillScope.PROJECT, "2", pinned=False, latest_version="3")
    harness.backends.answers["read_skill"] = SkillContent(skill, content)
    outcome = await harness.run("read_skill", {"name": "planning"})
    assert not outcome.is_error
    size = len(outcome.content.encode())
    assert MAX_RESULT_BYTES - 16 <= size <= MAX_RESULT_BYTES
    document = json.loads(outcome.content)
    assert document["truncated"] is True
    assert document["original_bytes"] > MAX_RESULT_BYTES
    kept = document["content"]
    assert kept["skill"] == {
        "name": "planning",
        "scope": "project",
        "version": "2",
        "pinned": False,
    }, "short fields stay whole"
    assert content.startswith(kept["content"]) and len(kept["content"]) > 1000


def test_a_small_result_is_left_alone() -> None:
    output = {"item": {"item_id": "T-1", "title": "ok"}}
    assert json.loads(cut_to_fit(output)) == output


def test_an_item_with_a_long_description_keeps_its_dependency_ids() -> None:
    output = {
        "item": {"item_id": "T-1", "blocked_by_ids": ["T-2", "T-3"], "description": "d" * 40_000}
    }
    document = json.loads(cut_to_fit(output, 2048))
    item = document["content"]["item"]
    assert item["blocked_by_ids"] == ["T-2", "T-3"]
    assert 1500 < len(item["description"]) < 2048


@pytest.mark.parametrize("limit", [256, 1000, 4096])
@pytest.mark.parametrize(
    "output",
    [
        "x" * 10_000,
        ["a" * 50] * 500,
        {"hits": [{"snippet": "s" * 300}] * 100, "next_page_token": "n"},
        {"a": ["b" * 10_000], "c": "d" * 10_000},
        {"deep": [[[["x" * 9000]]]]},
        [1] * 10_000,
    ],
)
def test_any_cut_is_valid_json_within_the_limit(output: Any, limit: int) -> None:
    text = cut_to_fit(output, limit)
    assert len(text.encode()) <= limit
    document = json.loads(text)
    assert document["truncated"] is True
    assert document["original_bytes"] > limit
