"""What a tool is: one ``Tool`` value holds its name, description, JSON Schema, the
permissions it needs, whether it writes, the backend RPCs it makes, and its run function
(arguments -> backend call -> our output shape). The tool modules (``tracker``,
``skills``, ``knowledge``) define the twelve side by side; ``registry`` lists them.

Also here: the schema builders every tool uses (Draft 2020-12, ``additionalProperties:
false`` at every object level), and the output helpers shared by the tool modules.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from service.core.backend_types import Acting
from service.core.model import JsonObject
from service.core.ports.backends import ToolBackends

# The permissions tools need (docs/spec/authority.md).
TRACKER_READ = "tracker.read"
TRACKER_WRITE = "tracker.write"
SKILL_READ = "skill.read"
KNOWLEDGE_READ = "knowledge.read"
KNOWLEDGE_WRITE = "knowledge.write"

#: The ranges of the backends' protobuf integer fields. Every integer a schema offers
#: lies inside the one its backend field holds (a unit test checks it).
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Invocation:
    """One validated call of a tool, as its run function gets it.

    ``request_id`` is the planner's own id of the tool call, unique in the session; write
    RPCs send it as their ``request_id`` (AIP-155; docs/spec/authority.md and
    docs/spec/turn-loop.md, Tool-call identity), never a provider's id. ``timeout_s`` is the
    backend's deadline in seconds.
    """

    backends: ToolBackends
    acting: Acting
    project_id: str
    request_id: str
    timeout_s: float


@dataclass(frozen=True)
class ToolResult:
    """A tool's JSON output (our shape, built by its run function), and for writes
    what was written, so the turn loop can emit ``changeset_proposed`` or
    ``knowledge_written`` (docs/spec/authority.md, Containment)."""

    output: JsonObject
    changeset_id: str = ""
    knowledge_entry_id: str = ""
    knowledge_version: int = 0


#: A tool's behaviour: validated arguments in, backend call(s), our output shape out.
#: Raises ``ToolFailure`` (the backend's refusal, or a problem only it can see).
RunTool = Callable[[Invocation, JsonObject], Awaitable[ToolResult]]


@dataclass(frozen=True)
class Tool:
    """One tool, whole.

    - ``schema``: its arguments' JSON Schema (Draft 2020-12, ``additionalProperties:
      false`` at every object level; unknown fields are rejected). No schema
      takes a project id or a policy (docs/spec/authority.md).
    - ``permissions``: what the tool needs; the human needs at least one of them
      (``search_project`` works with either). The backends enforce them; this documents
      them and labels metrics.
    - ``is_write``: counts against ``planner.max_writes_per_turn`` (docs/spec/authority.md).
    - ``rpcs``: the backend RPCs ``run`` makes (``Service.Method``), for readers and for
      the test that runs every tool against the devstack.
    - ``run``: the behaviour (see ``RunTool``).
    """

    name: str
    description: str
    schema: JsonObject
    permissions: tuple[str, ...]
    rpcs: tuple[str, ...]
    run: RunTool
    is_write: bool = False


# --------------------------------------------------------------------------- schemas


def object_schema(properties: JsonObject, *required: str, **extra: Any) -> JsonObject:
    """A closed object: ``additionalProperties: false`` (docs/spec/turn-loop.md)."""
    schema: JsonObject = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    schema["additionalProperties"] = False
    schema.update(extra)
    return schema


def string(description: str, *, max_length: int = 200, min_length: int = 1) -> JsonObject:
    """A string; ``description`` "" when the field's name says enough (it is left out)."""
    return _described(
        {"type": "string", "minLength": min_length, "maxLength": max_length}, description
    )


def enum(description: str, *values: str) -> JsonObject:
    return _described({"type": "string", "enum": list(values)}, description)


def integer(description: str, minimum: int, maximum: int) -> JsonObject:
    return _described({"type": "integer", "minimum": minimum, "maximum": maximum}, description)


def id_list(description: str) -> JsonObject:
    return _described(
        {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 200},
            "maxItems": 100,
            "uniqueItems": True,
        },
        description,
    )


def _described(schema: JsonObject, description: str) -> JsonObject:
    if description:
        schema["description"] = description
    return schema


TITLE_CHARS = 200
TEXT_CHARS = 20_000
BODY_CHARS = 100_000

#: The instructions say once how page tokens work (a list result's next_page_token).
PAGE_TOKEN = string("", max_length=1000)

#: Keywords only the planner's validation needs: it enforces them and answers a call
#: that breaks one with an error result naming the field, so the declaration the model
#: reads leaves them out (decision 0295). Where a bound matters to the model (a
#: priority's range, a default), the field's description says it in words.
VALIDATION_ONLY = frozenset(
    {
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "uniqueItems",
        "minimum",
        "maximum",
        "minProperties",
        "maxProperties",
    }
)


def declared_schema(schema: JsonObject) -> JsonObject:
    """``schema`` as offered to the model: the same structure, types, enums, required
    fields, ``additionalProperties: false`` and descriptions, without the
    ``VALIDATION_ONLY`` keywords (decision 0295). Validation keeps the whole schema."""
    out: JsonObject = {}
    for key, value in schema.items():
        if key in VALIDATION_ONLY:
            continue
        if key == "properties":
            out[key] = {name: declared_schema(sub) for name, sub in value.items()}
        elif key == "items" and isinstance(value, dict):
            out[key] = declared_schema(value)
        else:
            out[key] = value
    return out


# --------------------------------------------------------------------------- outputs


def rfc3339(moment: datetime) -> str:
    """``moment`` (aware, UTC) as RFC 3339 with ``Z`` and 0, 3 or 6 fractional digits:
    the form protobuf's JSON gives a ``Timestamp`` (the outputs kept their shape when
    the tools stopped reading protobuf; decision 0130)."""
    text = moment.replace(tzinfo=None, microsecond=0).isoformat()
    micros = moment.microsecond
    if micros == 0:
        return text + "Z"
    if micros % 1000 == 0:
        return f"{text}.{micros // 1000:03d}Z"
    return f"{text}.{micros:06d}Z"


def set_time(output: JsonObject, key: str, moment: datetime | None) -> None:
    """Add ``key`` when the backend sent a time (optional fields are left out)."""
    if moment is not None:
        output[key] = rfc3339(moment)


def score(value: float) -> float:
    """A search score as the model reads it: four decimals."""
    return round(value, 4)
