"""The declared tools and the implemented ones cannot differ.

Declared: the tools of docs/spec/authority.md and what ``declarations()`` offers the model.
Implemented: the ``Tool`` units (schema and run function), the ``ToolBackends`` methods
they call, and the gRPC adapter behind the port. (The run-time proof that the adapter
answers every tool is ``tests/service/test_backends.py::test_every_tool_once_on_the_devstack``.)
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest
from ballet.knowledge.v1 import knowledge_pb2
from ballet.skills.v1 import skills_pb2
from ballet.tracker.v1 import tracker_pb2
from jsonschema import Draft202012Validator

from service.adapters.backends import GrpcToolBackends
from service.core.ports import Acting, ToolBackends, ToolCall
from service.core.tools import (
    TOOLS,
    TOOLS_BY_NAME,
    Tool,
    ToolContext,
    ToolRunner,
    declarations,
    declared_schema,
)
from tests.unit.fakes import FakeBackends
from tests.unit.test_tools import VALID_ARGUMENTS

#: The tools of docs/spec/authority.md, in its order (docs/spec/turn-loop.md).
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
#: The port's methods for the system prompt; every other method serves exactly one tool.
PROMPT_METHODS = {"get_project", "read_skill"}
SERVICES = {
    "TrackerService": tracker_pb2.DESCRIPTOR,
    "SkillsService": skills_pb2.DESCRIPTOR,
    "KnowledgeService": knowledge_pb2.DESCRIPTOR,
}
ACTING = Acting(human_id="alice", organization_id="acme", token="tok", session_id="s1")


def port_methods() -> set[str]:
    return {
        name
        for name, member in vars(ToolBackends).items()
        if inspect.iscoroutinefunction(member) and not name.startswith("_")
    }


def test_the_registry_is_the_seeds_table() -> None:
    assert tuple(tool.name for tool in TOOLS) == SEED_TOOLS
    assert list(TOOLS_BY_NAME) == list(SEED_TOOLS)
    assert [d.name for d in declarations()] == list(SEED_TOOLS)


@pytest.mark.parametrize("tool", TOOLS, ids=lambda tool: tool.name)
def test_each_unit_has_its_schema_run_function_and_rpcs(tool: Tool) -> None:
    Draft202012Validator.check_schema(tool.schema)
    declared = next(d for d in declarations() if d.name == tool.name)
    assert json.loads(declared.parameters_json_schema) == declared_schema(tool.schema)
    assert declared.description == tool.description
    assert inspect.iscoroutinefunction(tool.run)
    assert tool.permissions and tool.rpcs
    for rpc in tool.rpcs:
        service, _, method = rpc.partition(".")
        assert method in SERVICES[service].services_by_name[service].methods_by_name, rpc


class Recording:
    """``FakeBackends`` behind a proxy that notes which port methods were called."""

    def __init__(self) -> None:
        self.fake = FakeBackends()
        self.called: list[str] = []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.fake, name)

        async def call(*args: Any) -> Any:
            self.called.append(name)
            return await method(*args)

        return call


async def test_every_tool_runs_and_the_tools_use_every_tool_method_of_the_port() -> None:
    recording = Recording()
    runner = ToolRunner(recording)  # type: ignore[arg-type]
    context = ToolContext(acting=ACTING, project_id="demo", reserve_write=lambda: True)
    used: dict[str, set[str]] = {}
    for tool in TOOLS:
        recording.called.clear()
        arguments = json.dumps(VALID_ARGUMENTS[tool.name])
        outcome = await runner.run(ToolCall(f"call-{tool.name}", tool.name, arguments), context)
        assert not outcome.is_error, (tool.name, outcome.content)
        assert len(recording.called) == len(tool.rpcs), (tool.name, recording.called)
        used[tool.name] = set(recording.called)
    # Each tool method of the port serves exactly one tool; none is left unused.
    every = [method for methods in used.values() for method in methods]
    assert sorted(every) == sorted(port_methods() - PROMPT_METHODS)


def test_the_grpc_adapter_has_every_port_method_with_its_parameters() -> None:
    # mypy checks the same statically (service/adapters/backends.py, _PORT).
    for name in port_methods():
        implemented = getattr(GrpcToolBackends, name)
        assert inspect.iscoroutinefunction(implemented), name
        expected = list(inspect.signature(getattr(ToolBackends, name)).parameters)
        assert list(inspect.signature(implemented).parameters) == expected, name
