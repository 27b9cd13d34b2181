"""Tool arguments that cannot reach an internal error (docs/spec/turn-loop.md and
docs/spec/limits.md).

Integral numbers written ``10.0`` are the integers they denote (decision 0131); numbers
beyond what the backend's field holds, non-integral numbers, lone surrogates and deep
nesting are error results naming the field, and never reach a backend; no argument value
is logged at INFO or above, and an unexpected failure is logged with the session id and
the tool's name.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from service.adapters import backend_messages
from service.core.backend_types import (
    CreateItem,
    ItemKind,
    ItemQuery,
    KnowledgeEntryChange,
    KnowledgeSearch,
)
from service.core.errors import ToolFailure
from service.core.tools import TOOLS, error_result
from service.core.tools.unit import INT32_MAX, INT64_MAX
from tests.unit.test_tools import VALID_ARGUMENTS, Harness, error_of
from tests.unit.test_tools import harness as harness  # the fixture

#: Each integer argument, where it sits, the tool's other arguments, and the largest
#: value its backend field holds (int32 unless the contract says int64).
INTEGER_FIELDS: list[tuple[str, str, dict[str, Any], int]] = [
    ("list_items", "$.page_size", {}, INT32_MAX),
    ("list_runnable", "$.page_size", {}, INT32_MAX),
    ("list_changesets", "$.page_size", {}, INT32_MAX),
    ("search_project", "$.limit", {"query": "q"}, INT32_MAX),
    ("search_knowledge", "$.limit", {"query": "q"}, INT32_MAX),
    ("update_knowledge", "$.version", {"entry_id": "K-1", "body": "b"}, INT64_MAX),
    (
        "propose_changeset",
        "$.operations[0].create_item.priority",
        {"title": "t"},
        INT32_MAX,
    ),
    (
        "propose_changeset",
        "$.operations[0].update_item.priority",
        {"title": "t"},
        INT32_MAX,
    ),
]


def with_number(tool: str, path: str, rest: dict[str, Any], number: str) -> str:
    """The arguments' JSON text with ``number`` written literally at ``path``."""
    marker = "__NUMBER__"
    arguments = dict(rest)
    if path.endswith("create_item.priority"):
        arguments["operations"] = [
            {"create_item": {"kind": "ticket", "title": "x", "priority": marker}}
        ]
    elif path.endswith("update_item.priority"):
        arguments["operations"] = [{"update_item": {"item_id": "T-1", "priority": marker}}]
    else:
        arguments[path.removeprefix("$.")] = marker
    return json.dumps(arguments).replace(f'"{marker}"', number)


def schema_integers(schema: Any, path: str = "$") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            yield path, schema
        for key, value in schema.items():
            yield from schema_integers(value, f"{path}/{key}")
    elif isinstance(schema, list):
        for index, value in enumerate(schema):
            yield from schema_integers(value, f"{path}/{index}")


@pytest.mark.parametrize("tool", TOOLS, ids=lambda tool: tool.name)
def test_every_integer_a_schema_offers_fits_its_backend_field(tool: Any) -> None:
    for path, schema in schema_integers(tool.schema):
        assert "minimum" in schema and "maximum" in schema, (tool.name, path)
        largest = INT64_MAX if path.endswith("/version") else INT32_MAX
        assert -largest - 1 <= schema["minimum"] <= schema["maximum"] <= largest, path
    assert "number" not in json.dumps(tool.schema).replace('"description"', ""), (
        "no schema takes a non-integral number; integral floats become integers (0131)"
    )


# --------------------------------------------------------------------------- 10.0 is 10


@pytest.mark.parametrize(
    ("tool", "text", "field", "expected"),
    [
        ("list_items", '{"page_size": 10.0}', "page_size", 10),
        ("list_items", '{"page_size": 1e1}', "page_size", 10),
        ("list_items", '{"page_size": 10.000}', "page_size", 10),
        ("search_knowledge", '{"query": "", "limit": 5E0}', "limit", 5),
        ("update_knowledge", '{"entry_id": "K-1", "version": 2.0, "body": "b"}', "version", 2),
        (
            "update_knowledge",
            '{"entry_id": "K-1", "version": 9223372036854775807.0, "body": "b"}',
            "version",
            INT64_MAX,
        ),
    ],
)
async def test_an_integral_number_is_the_integer(
    harness: Harness, tool: str, text: str, field: str, expected: int
) -> None:
    outcome = await harness.run(tool, text, raw=True)
    assert not outcome.is_error, outcome.content
    (call,) = harness.backends.calls
    value = getattr(call.request, field)
    assert value == expected and type(value) is int


@pytest.mark.parametrize("number", ["-0.0", "0e999999", "0.000", "4e0", "400e-2"])
async def test_an_integral_priority_in_an_operation_is_the_integer(
    harness: Harness, number: str
) -> None:
    operation = '{"create_item": {"kind": "epic", "title": "E", "priority": ' + number + "}}"
    text = '{"title": "t", "operations": [' + operation + "]}"
    outcome = await harness.run("propose_changeset", text, raw=True)
    assert not outcome.is_error, outcome.content
    (call,) = harness.backends.calls
    (created,) = call.request.operations
    assert created == CreateItem(ItemKind.EPIC, "E", priority=round(float(number)))
    assert type(created.priority) is int


# --------------------------------------------------------------------------- out of range


@pytest.mark.parametrize(
    "number",
    [
        "{above}",
        "{below}",
        str(2**70),
        str(-(2**40)),
        str(2**63),
        str(-(2**63) - 1),
        "1e400",
        "-1e400",
        "1e19",
        "10.5",
        "1.0000000000000000001",
        "1" * 5000,
    ],
)
@pytest.mark.parametrize(
    ("tool", "path", "rest", "largest"),
    INTEGER_FIELDS,
    ids=[f"{tool}:{path}" for tool, path, _, _ in INTEGER_FIELDS],
)
async def test_a_number_the_field_cannot_hold_is_an_error_result_naming_it(
    harness: Harness, tool: str, path: str, rest: dict[str, Any], largest: int, number: str
) -> None:
    number = number.format(above=largest + 1, below=-largest - 2)
    outcome = await harness.run(tool, with_number(tool, path, rest, number), raw=True)
    error = error_of(outcome)
    assert error["reason"] == "INVALID_ARGUMENTS"
    if len(number) < 100:
        # (a 5,000-digit integer is refused by the JSON parser before any field is known)
        assert error["message"].startswith(f"{path}: "), error["message"]
    assert harness.backends.calls == []


@pytest.mark.parametrize(
    ("tool", "path", "rest", "largest"),
    INTEGER_FIELDS,
    ids=[f"{tool}:{path}" for tool, path, _, _ in INTEGER_FIELDS],
)
async def test_the_bounds_of_the_schema_are_what_reaches_the_backend(
    harness: Harness, tool: str, path: str, rest: dict[str, Any], largest: int
) -> None:
    schema_max = {"$.page_size": 100 if tool == "list_changesets" else 500, "$.limit": 50}
    top = schema_max.get(path, INT64_MAX if path == "$.version" else 4)
    outcome = await harness.run(tool, with_number(tool, path, rest, str(top)), raw=True)
    assert not outcome.is_error, outcome.content
    beyond = await harness.run(tool, with_number(tool, path, rest, str(top + 1)), raw=True)
    assert error_of(beyond)["message"].startswith(f"{path}: ")
    assert len(harness.backends.calls) == 1


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (
            lambda: backend_messages.list_items_request(ItemQuery("demo", page_size=2**31)),
            "page_size",
        ),
        (
            lambda: backend_messages.search_knowledge_request(KnowledgeSearch("q", -(2**40))),
            "limit",
        ),
        (
            lambda: backend_messages.update_knowledge_request(
                KnowledgeEntryChange("r", "K-1", version=2**63)
            ),
            "version",
        ),
        (
            lambda: backend_messages.update_knowledge_request(
                KnowledgeEntryChange("r", "K-1", version=2.0)  # type: ignore[arg-type]
            ),
            "version",
        ),
    ],
)  # fmt: skip
def test_the_adapter_refuses_a_number_its_field_cannot_hold_naming_it(
    build: Any, name: str
) -> None:
    # Behind the schema, a second guard: a caller of the port that skipped validation
    # still gets an error result naming the field, not an encoding error.
    with pytest.raises(ToolFailure) as raised:
        build()
    assert raised.value.reason == "INVALID_ARGUMENTS"
    assert raised.value.message.startswith(f"{name} must be")


# --------------------------------------------------------------------------- strings, depth


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ('{"item_id": "T-\\ud800"}', "$.item_id"),
        ('{"item_id": "\\udfff\\ud83d"}', "$.item_id"),
        ('{"item_id": "T-1", "\\ud800": 1}', "$['\\ud800']"),
    ],
)
async def test_a_lone_surrogate_is_an_error_result_that_still_encodes(
    harness: Harness, text: str, path: str
) -> None:
    outcome = await harness.run("get_item", text, raw=True)
    error = error_of(outcome)
    assert error["reason"] == "INVALID_ARGUMENTS"
    assert error["message"].startswith(path)
    outcome.content.encode("utf-8")  # storable and sendable as it is
    assert harness.backends.calls == []


async def test_a_surrogate_pair_is_one_character_and_runs(harness: Harness) -> None:
    outcome = await harness.run("get_item", '{"item_id": "T-\\ud83d\\ude00"}', raw=True)
    assert not outcome.is_error
    assert harness.backends.calls[0].request == "T-😀"


@pytest.mark.parametrize("depth", [33, 200, 100_000])
async def test_deep_nesting_is_an_error_result(harness: Harness, depth: int) -> None:
    text = '{"item_ids": ' + "[" * depth + "]" * depth + ', "kind": "note"}'
    outcome = await harness.run("create_knowledge", text, raw=True)
    assert error_of(outcome)["reason"] == "INVALID_ARGUMENTS"
    assert harness.backends.calls == []
    assert harness.writes.asked == 0


def test_an_error_message_always_encodes() -> None:
    outcome = error_result("INVALID_ARGUMENTS", "bad \udc80 text")
    assert json.loads(outcome.content.encode("utf-8"))["error"]["message"] == "bad ? text"


# --------------------------------------------------------------------------- logging

SECRET = "alice-private-words-7f3a"


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)
    return caplog


def loud(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.levelno >= logging.INFO]


def rendered(record: logging.LogRecord) -> str:
    text = record.getMessage()
    if record.exc_info:
        text += logging.Formatter().formatException(record.exc_info)
    return text + repr(record.__dict__)


async def test_an_unexpected_failure_is_logged_with_session_and_tool_only(
    harness: Harness, logs: pytest.LogCaptureFixture
) -> None:
    # The exception's text quotes the argument, as protobuf's range errors did.
    harness.backends.answers["get_item"] = ValueError(f"Value out of range: {SECRET}")
    outcome = await harness.run("get_item", {"item_id": SECRET})
    assert error_of(outcome) == {
        "reason": "BACKEND_ERROR",
        "message": "the tool failed unexpectedly",
    }
    (record,) = loud(logs)
    assert record.levelno == logging.ERROR
    assert record.__dict__["session"] == "s1"
    assert "get_item" in record.getMessage() and "ValueError" in record.getMessage()
    assert record.exc_info is None
    assert SECRET not in rendered(record)
    # The traceback, for a developer who turned DEBUG on.
    assert any(r.levelno == logging.DEBUG and r.exc_info for r in logs.records)


@pytest.mark.parametrize(
    "arguments",
    [
        {"item_id": SECRET, "extra": SECRET},
        {"item_id": [SECRET]},
        {SECRET: 1},
        {"item_id": SECRET * 100},
    ],
)
async def test_no_argument_value_is_logged_at_info_or_above(
    harness: Harness, logs: pytest.LogCaptureFixture, arguments: dict[str, Any]
) -> None:
    for name in ("get_item", "no_such_tool", "propose_changeset"):
        await harness.run(name, arguments)
    harness.backends.failures["get_item"] = ToolFailure("NOT_FOUND", f"no item {SECRET}")
    await harness.run("get_item", {"item_id": SECRET})
    await harness.run("get_item", '{"item_id": "' + SECRET + '"', raw=True)
    assert all(SECRET not in rendered(record) for record in loud(logs))


async def test_valid_examples_still_run(harness: Harness) -> None:
    for name, arguments in VALID_ARGUMENTS.items():
        assert not (await harness.run(name, arguments)).is_error, name
