"""The twelve tools of the tools of docs/spec/authority.md, in its order, and what is offered to the
model (docs/spec/turn-loop.md step 4)."""

from __future__ import annotations

import json
from collections.abc import Mapping

from jsonschema import Draft202012Validator

from service.core.ports.model import ToolDeclaration
from service.core.tools import knowledge, skills, tracker
from service.core.tools.unit import Tool, declared_schema

#: The version of the tool names, descriptions and schemas; recorded on each turn
#: (docs/spec/turn-loop.md step 2). Bump it whenever a declaration changes: a unit test pins a
#: fingerprint of ``declarations()``.
TOOL_SCHEMA_VERSION = "tools-2026-12-2"

TOOLS: tuple[Tool, ...] = (*tracker.TOOLS, *skills.TOOLS, *knowledge.TOOLS)
TOOLS_BY_NAME: Mapping[str, Tool] = {tool.name: tool for tool in TOOLS}
#: The write tools (docs/spec/authority.md, Containment).
WRITE_TOOLS = frozenset(tool.name for tool in TOOLS if tool.is_write)

VALIDATORS: Mapping[str, Draft202012Validator] = {
    tool.name: Draft202012Validator(tool.schema) for tool in TOOLS
}


def declarations() -> list[ToolDeclaration]:
    """The twelve tools as offered to the model: name, description, and the JSON Schema
    text of ``declared_schema`` (the validation bounds left out; decision 0295).

    The schema text is the same on every call (stable key order), so a provider's prompt
    cache keeps working across turns, sessions and projects.
    """
    return [
        ToolDeclaration(
            name=tool.name,
            description=tool.description,
            parameters_json_schema=json.dumps(declared_schema(tool.schema), separators=(",", ":")),
        )
        for tool in TOOLS
    ]
