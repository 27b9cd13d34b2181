"""Rules of docs/spec/ (turn-loop.md, authority.md), shown through the real service: the
planner and the devstack (backends and LLM gateway) on loopback, a scripted model, the
results read from what the planner stored and what the gateway received.

- "it answers with the model configured in [planner]": a non-default ``[planner] model``
  from a configuration file reaches the gateway and is recorded on the turn;
- Tools, list_changesets, "optionally by status": on a project with applied, rejected
  and proposed changesets, each status gives exactly its changesets;
- Tools, search_knowledge, "optional kind, limit": ``limit`` bounds the hits;
- Tools, "Each tool's input ... described to the model by a JSON Schema": the model
  request carries the twelve tools of docs/spec/authority.md, each with a closed schema;
- Limits, "Model calls ... are metered to the project": a turn's usage lands in the
  gateway's ledger under the session's project, with that project's credential.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import sqlalchemy as sa
from ballet.llm.v1 import gateway_pb2
from ballet.planner.v1 import planner_service_pb2 as pb
from ballet.planner.v1 import planner_service_pb2_grpc, resources_pb2

from devstack.dev import DevApp, DevOptions, start_dev
from devstack.gateway.openai_provider import chat_messages, chat_tools
from devstack.store.schema import changesets
from service.config import PlannerSettings

#: The tools of docs/spec/authority.md, in its order.
SEED_TOOLS = (
    "list_items",
    "get_item",
    "list_runnable",
    "search_project",
    "list_changesets",
    "propose_changeset",
    "list_skills",
    "read_skill",
    "search_knowledge",
    "get_knowledge",
    "create_knowledge",
    "update_knowledge",
)
MODEL = "seed-test-model-7b"
INPUT_TOKENS, OUTPUT_TOKENS = 1234, 56


def human(regex: str, reply: dict[str, Any]) -> dict[str, Any]:
    return {
        "match": {"purpose": "turn", "last_role": "human", "last_text_regex": regex},
        "reply": reply,
    }


def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"text": "", "tool_calls": [{"name": name, "arguments": arguments}]}


SCENARIO = {
    "rules": [
        {"match": {"purpose": "turn", "last_role": "tool"}, "reply": {"text": "Done."}},
        human(
            r"^propose (?P<title>\w+)$",
            call(
                "propose_changeset",
                {
                    "title": "{{match:title}}",
                    "operations": [{"create_item": {"kind": "ticket", "title": "{{match:title}}"}}],
                },
            ),
        ),
        human(
            r"^changesets (?P<status>\w+)$", call("list_changesets", {"status": "{{match:status}}"})
        ),
        human(r"^all changesets$", call("list_changesets", {})),
        human(r"^knowledge, two$", call("search_knowledge", {"query": "", "limit": 2})),
        human(r"^knowledge$", call("search_knowledge", {"query": ""})),
        human(
            r"^usage$",
            {
                "text": "Metered.",
                "usage": {"input_tokens": INPUT_TOKENS, "output_tokens": OUTPUT_TOKENS},
            },
        ),
        {"reply": {"text": "Hello."}},
    ]
}


@dataclass
class Seed:
    """The running stack and a PlannerService stub."""

    app: DevApp
    stub: Any

    def metadata(self, user: str = "alice") -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.app.stack.token(user)}"),)

    async def session(self, project: str = "demo", user: str = "alice") -> str:
        created = await self.stub.CreateSession(
            pb.CreateSessionRequest(request_id=uuid.uuid4().hex, project_id=project),
            metadata=self.metadata(user),
        )
        return str(created.session.session_id)

    async def turn(self, session_id: str, text: str, user: str = "alice") -> pb.SendMessageResponse:
        response: pb.SendMessageResponse = await self.stub.SendMessage(
            pb.SendMessageRequest(request_id=uuid.uuid4().hex, session_id=session_id, text=text),
            metadata=self.metadata(user),
            timeout=60,
        )
        assert response.turn.end_reason == resources_pb2.TURN_END_REASON_COMPLETED, response
        return response

    async def tool_result(self, session_id: str, text: str) -> Any:
        """The JSON result of the one tool call ``text`` makes, as the planner stored it."""
        messages = (await self.turn(session_id, text)).messages
        (result,) = [m for m in messages if m.kind == resources_pb2.MESSAGE_KIND_TOOL_RESULT]
        assert not result.tool_error, result.tool_result
        return json.loads(result.tool_result)


@pytest.fixture(scope="module")
async def seed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Seed]:
    folder = tmp_path_factory.mktemp("seed")
    (folder / "scenario.json").write_text(json.dumps(SCENARIO))
    (folder / "planner.toml").write_text(f'[planner]\nmodel = "{MODEL}"\n')
    app = await start_dev(
        DevOptions(
            config_file=folder / "planner.toml",
            data_dir=folder / "data",
            scenario=folder / "scenario.json",
            address="127.0.0.1:0",
            devstack_address="127.0.0.1:0",
        ),
        {"BALLET_PLANNER__SERVER__METRICS_ADDRESS": "", "BALLET_PLANNER__SERVER__GRACE_S": "7"},
    )
    channel = grpc.aio.insecure_channel(app.planner.address)
    try:
        yield Seed(app, planner_service_pb2_grpc.PlannerServiceStub(channel))
    finally:
        await channel.close()
        await app.stop()


def turn_requests(seed: Seed, since: int) -> list[gateway_pb2.GenerateRequest]:
    return [r for r in seed.app.gateway.requests[since:] if r.purpose == gateway_pb2.PURPOSE_TURN]


async def test_the_configured_planner_model_reaches_the_gateway(seed: Seed) -> None:
    assert PlannerSettings().model != MODEL  # the file's value, not the default
    before = len(seed.app.gateway.requests)
    session = await seed.session()
    response = await seed.turn(session, "hello")
    (request,) = turn_requests(seed, before)
    assert request.model == MODEL
    assert response.turn.model == MODEL


async def test_list_changesets_filters_by_status(seed: Seed) -> None:
    session = await seed.session()
    proposed = {}
    for title in ("alpha", "beta", "gamma"):
        result = await seed.tool_result(session, f"propose {title}")
        proposed[title] = result["changeset"]["changeset_id"]

    # A human applies alpha and rejects beta (in Core; here, in the devstack's store).
    async def decide(session: Any) -> None:
        for title, status in (("alpha", "applied"), ("beta", "rejected")):
            await session.execute(
                sa.update(changesets)
                .where(changesets.c.changeset_id == proposed[title])
                .values(status=status)
            )

    await seed.app.stack.store.run_write(decide)

    def titles(result: Any, status: str) -> set[str]:
        listed = result["changesets"]
        assert {c["status"] for c in listed} <= {status}, listed
        return {c["title"] for c in listed} & set(proposed)

    assert titles(await seed.tool_result(session, "changesets applied"), "applied") == {"alpha"}
    assert titles(await seed.tool_result(session, "changesets rejected"), "rejected") == {"beta"}
    assert titles(await seed.tool_result(session, "changesets proposed"), "proposed") == {"gamma"}
    everything = await seed.tool_result(session, "all changesets")
    assert {c["title"] for c in everything["changesets"]} >= {"alpha", "beta", "gamma"}


async def test_search_knowledge_honours_limit(seed: Seed) -> None:
    session = await seed.session()
    unlimited = await seed.tool_result(session, "knowledge")
    assert len(unlimited["hits"]) > 2  # the demo organization has more entries than that
    limited = await seed.tool_result(session, "knowledge, two")
    assert len(limited["hits"]) == 2
    assert [h["entry_id"] for h in limited["hits"]] == [
        h["entry_id"] for h in unlimited["hits"][:2]
    ]


async def test_the_model_request_carries_the_twelve_tool_declarations(seed: Seed) -> None:
    before = len(seed.app.gateway.requests)
    await seed.turn(await seed.session(), "hello")
    (request,) = turn_requests(seed, before)
    assert sorted(tool.name for tool in request.tools) == sorted(SEED_TOOLS)
    for tool in request.tools:
        schema = json.loads(tool.parameters_json_schema)
        assert schema["type"] == "object", tool.name
        assert schema["additionalProperties"] is False, tool.name  # unknown fields rejected
        assert tool.description, tool.name


async def test_sessions_of_a_project_send_one_prefix_and_projects_share_the_first_part(
    seed: Seed,
) -> None:
    # Decision 0296 (target T8): instructions and tools first, the same for every project;
    # then the project block, the same for every session of the project.
    before = len(seed.app.gateway.requests)
    for project, user in (("demo", "alice"), ("demo", "alice"), ("globex-ops", "carol")):
        await seed.turn(await seed.session(project, user), "hello", user)
    first, second, other = turn_requests(seed, before)

    def shared(request: gateway_pb2.GenerateRequest) -> bytes:
        part = gateway_pb2.GenerateRequest(system_prompt=request.system_prompt)
        part.tools.extend(request.tools)
        return part.SerializeToString(deterministic=True)

    assert shared(first) == shared(second) == shared(other)
    assert first.system_context == second.system_context
    assert "- id: demo" in first.system_context and "- id: globex-ops" in other.system_context
    assert "demo" not in first.system_prompt and "globex" not in other.system_prompt
    # As an OpenAI-compatible server gets them: the same first system message and tools,
    # the project's own system message after it.
    demo, globex = chat_messages(first), chat_messages(other)
    assert demo[0] == globex[0] and demo[1] != globex[1]
    assert chat_messages(second)[:2] == demo[:2]
    assert chat_tools(first) == chat_tools(second) == chat_tools(other)


async def test_a_turns_usage_lands_in_the_ledger_under_the_sessions_project(seed: Seed) -> None:
    ledger = seed.app.gateway.ledger
    for user, project, credential in (
        ("alice", "demo", "demo-credential"),
        ("carol", "globex-ops", "globex-credential"),
    ):
        before = ledger.totals(project)
        others = {p: ledger.totals(p) for p in ("demo", "globex-ops") if p != project}
        session = await seed.session(project, user)
        response = await seed.turn(session, "usage", user)
        assert (response.turn.usage.input_tokens, response.turn.usage.output_tokens) == (
            INPUT_TOKENS,
            OUTPUT_TOKENS,
        )
        after = ledger.totals(project)
        assert (after.calls, after.input_tokens, after.output_tokens) == (
            before.calls + 1,
            before.input_tokens + INPUT_TOKENS,
            before.output_tokens + OUTPUT_TOKENS,
        )
        assert {p: ledger.totals(p) for p in others} == others  # nothing metered elsewhere
        last = ledger.records[-1]
        assert (last.project_id, last.credential_ref, last.model) == (project, credential, MODEL)
