"""A property-based test of every tool's arguments (decision 0131):
``ToolRunner`` -> ``GrpcToolBackends`` -> the real devstack backends on loopback.

Hypothesis draws, for each tool, arguments shaped by its JSON Schema whose every field
may instead hold a hostile value: integers far beyond int32 and int64 and just past each
bound, integral floats written ``10.0`` or ``1e1``, ``1e400``, ``NaN`` and ``Infinity``
literals, lone surrogate escapes, NUL and other Unicode, strings past every length limit,
deep nesting, unknown fields, wrong types; and whole argument texts that are not JSON
objects at all. Each example runs one call as alice (every permission) or bob (reads
only), with its own call id.

Properties, per example: the runner returns (no exception); the result is valid JSON of
at most 16 KiB that encodes as UTF-8; an error result's reason is one the input or the
human's permissions explain, never ``BACKEND_ERROR`` (nor a timeout or an outage); and no
backend call of the example ended ``INTERNAL`` or ``UNKNOWN``.

2,000 Hypothesis examples per tool family (tracker, skills, knowledge); an input that
Hypothesis reaches again by other draws is checked once. About 45% of the examples reach
a backend; the three tests take about 30 s of CPU on the 2-core CI machine.
``--hypothesis-show-statistics`` shows which outcomes the examples reached. Marked slow,
with the other fuzz tests (``scripts/test -m "not slow"`` leaves them out).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ballet_common.grpc.channels import make_channel
from ballet_common.tokens import KNOWLEDGE_AUDIENCE, SKILLS_AUDIENCE, TRACKER_AUDIENCE
from devstack.server import DevStack, DevStackConfig
from service.adapters.backends import GrpcToolBackends
from service.core.ports import Acting, ToolCall
from service.core.tools import (
    MAX_RESULT_BYTES,
    TOOLS_BY_NAME,
    ToolContext,
    ToolRunner,
    knowledge,
    skills,
    tracker,
)

EXAMPLES_PER_FAMILY = 2000
FAMILIES = {
    "tracker": [tool.name for tool in tracker.TOOLS],
    "skills": [tool.name for tool in skills.TOOLS],
    "knowledge": [tool.name for tool in knowledge.TOOLS],
}
#: Error reasons the input or the human's permissions explain. BACKEND_ERROR (a bug),
#: BACKEND_UNAVAILABLE, DEADLINE_EXCEEDED and CREDENTIAL_EXPIRED are not among them.
EXPLAINED = {
    "INVALID_ARGUMENTS",
    "POLICY_CHANGE_NOT_ALLOWED",
    "PERMISSION_DENIED",
    "NOT_FOUND",
    "STALE_VERSION",
    "CONFLICT",
}
BUG_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- values


@dataclass(frozen=True)
class Raw:
    """A piece of JSON text written as it is: number literals Python's ``json`` would not
    write (``1e400``, ``10.0`` as text, ``NaN``), escapes (``"\\ud800"``), deep nesting."""

    text: str


def to_text(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{to_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(to_text(v) for v in value) + "]"
    return json.dumps(value)


INT_EDGES = [
    0, -1, 1, 4, 5, 50, 51, 100, 101, 500, 501,
    2**31 - 1, 2**31, -(2**31), -(2**31) - 1,
    2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 2**70, -(2**40), 10**30,
]  # fmt: skip
RAW_NUMBERS = [
    "10.0", "1.0", "2.0", "0.0", "-0.0", "1e1", "1E2", "5e-1", "10.5", "1e400", "-1e400",
    "1e19", "0e999999", "9223372036854775807.0", "9223372036854775808.0",
    "1.0000000000000000001", "NaN", "Infinity", "-Infinity", "1" * 400, "1" * 5000,
]  # fmt: skip
RAW_TEXTS = [
    '"\\ud800"', '"a\\udfffb"', '"\\ud83d\\ude00"', '"\\u0000"', '"\\u202e"',
    "[" * 40 + "]" * 40, "[" * 3000 + "]" * 3000, '{"a":' * 40 + "1" + "}" * 40,
]  # fmt: skip
KNOWN_IDS = [
    "PAN-1", "PAN-4", "PAN-9", "PAN-13", "PAN-19", "PAN-999", "demo-planning",
    "release-notes", "ticket-writing", "no-such-skill", "recipes", "e",
]  # fmt: skip
ODD_TEXTS = [
    "", " ", "\x00", "x" * 201, "é" * 1001, "y" * 20_001, "z" * 100_001, "日本語", "🎉" * 60,
    # Search syntax a backend's full-text engine may choke on.
    '"', "'", "a AND", "NEAR(", "*", "-", "title:x", "^", ")(", "%_", "\\", "a OR OR b",
]  # fmt: skip
#: Values any field may get instead of a plausible one: wrong types, numbers beyond every
#: range, literals Python would not write, malformed text, containers, deep nesting.
HOSTILE: list[Any] = [
    *INT_EDGES,
    *(Raw(text) for text in RAW_NUMBERS + RAW_TEXTS),
    *ODD_TEXTS,
    True, False, None, 10.0, -0.0, 0.5, 1e300, 2.0**63,
    [], {}, [1, "a"], {"policy": {"mode": "auto"}}, {"a": {"b": [None]}}, ["PAN-9"] * 101,
]  # fmt: skip


def pick(items: list[Any]) -> st.SearchStrategy[Any]:
    """One of ``items`` by its index (``st.sampled_from`` inspects every element, which
    costs more than the rest of an example for lists holding dicts)."""
    return st.integers(0, len(items) - 1).map(items.__getitem__)


#: Short text, as Hypothesis draws it: any code point but surrogates, NUL included.
short_text = st.text(max_size=24)
#: What a mutation writes: a hostile value, or fresh random text or integer.
mutation_value = st.one_of(pick(HOSTILE), short_text, st.integers())
#: A mutation that removes the key instead of setting it.
DELETE = Raw("<delete>")


def plausible_values(schema: dict[str, Any]) -> list[Any]:
    """A few values the schema accepts: its enum, its integer bounds (some written the
    way a model may, ``4.0``), the demo's ids and strings at its length limits."""
    if "enum" in schema:
        return list(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        low, high = schema.get("minimum", -(2**63)), schema.get("maximum", 2**63 - 1)
        return [low, high, (low + high) // 2, Raw(f"{low}.0"), Raw(f"{high}e0")]
    if kind == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength", 100)
        known = [t for t in KNOWN_IDS + ODD_TEXTS if low <= len(t) <= high]
        return [*known, "é" * min(high, 1000)]
    if kind == "array":
        items = plausible_values(schema["items"])
        return [items[:1], items[:2], []][: 3 if schema.get("minItems", 0) == 0 else 2]
    if kind == "object":
        return bases(schema)[:6]
    return [None]


def bases(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """Argument objects the schema (mostly) accepts: the required fields, then each
    optional field with each of its plausible values, then every field at once; objects
    with too few fields for ``minProperties`` get the first optional ones added."""
    properties: dict[str, Any] = schema.get("properties", {})
    if schema.get("maxProperties") == 1:  # an operation: exactly one key
        return [{name: base} for name, sub in properties.items() for base in bases(sub)]
    first = {name: plausible_values(sub)[0] for name, sub in properties.items()}
    required = {name: first[name] for name in schema.get("required", [])}
    found = [dict(required)]
    for name, sub in properties.items():
        for value in plausible_values(sub):
            found.append({**required, name: value})
    found.append({name: plausible_values(sub)[-1] for name, sub in properties.items()})
    least = schema.get("minProperties", 0)
    for base in found:
        for name in properties:
            if len(base) >= least:
                break
            base.setdefault(name, first[name])
    return found


def paths(
    schema: dict[str, Any], prefix: tuple[Any, ...] = ()
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Where a mutation may write, with the schema of what belongs there: every field,
    every item of an array, every nested object, a key no schema names (at the top; the
    policy check and the schema refuse one at any depth alike), and the whole value."""
    found: list[tuple[tuple[Any, ...], dict[str, Any]]] = [(prefix, schema)]
    if not prefix:
        found.append((("surplus",), {}))
    for name, sub in schema.get("properties", {}).items():
        found.append(((*prefix, name), sub))
        if sub.get("type") == "array":
            found.append(((*prefix, name, 0), sub["items"]))
            if sub["items"].get("type") == "object":
                found.extend(paths(sub["items"], (*prefix, name, 0)))
        elif sub.get("type") == "object":
            found.extend(paths(sub, (*prefix, name)))
    return found


@st.composite
def integral(draw: st.DrawFn, low: int, high: int) -> Any:
    """An integer in ``[low, high]``, written as JSON writers do: ``7``, ``7.0``, ``7e0``
    or ``7.000`` (decision 0131: all four are the integer 7)."""
    number = draw(st.integers(low, high))
    return (number, Raw(f"{number}.0"), Raw(f"{number}e0"), Raw(f"{number}.000"))[
        draw(st.integers(0, 3))
    ]


def fitting(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A fresh value of the right type for ``schema``: random text of an allowed length,
    an integer in range (maybe written ``7.0``), or just past it, an enum member."""
    if "enum" in schema:
        return pick(list(schema["enum"]))
    kind = schema.get("type")
    if kind == "integer":
        low, high = schema.get("minimum", -(2**63)), schema.get("maximum", 2**63 - 1)
        edges = [low - 1, high + 1, Raw(f"{high + 1}.0"), 2**31, 2**63, 2**70, -(2**40)]
        return st.one_of(integral(low, high), pick(edges))
    if kind == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength", 100)
        return st.text(min_size=low, max_size=min(high, 24))
    return pick(plausible_values(schema)) if kind else mutation_value


def mutate(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    """``value`` with ``new`` at ``path`` (containers made as needed); ``DELETE`` removes."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(head, int):
        items = list(value) if isinstance(value, list) else []
        if not items:
            items.append({})
        index = min(head, len(items) - 1)
        items[index] = mutate(items[index], rest, new)
        return items
    copy = dict(value) if isinstance(value, dict) else {}
    if new is DELETE and not rest:
        copy.pop(head, None)
    else:
        copy[head] = mutate(copy.get(head), rest, new)
    return copy


anything_text = st.lists(mutation_value, max_size=3).map(to_text)
TEXT_JUNK = ["", "{", "null", "[]", "3", '"x"', "{}", '{"a":NaN}', "{" * 5000, "[" * 100_000]


def argument_text(tool: str) -> st.SearchStrategy[str]:
    """The arguments of one call of ``tool``: one of its bases, unchanged one time in six,
    else with one to three mutations (a fresh value of the right type, a hostile value, or
    a key removed); one time in ten, text that is no object at all."""
    schema = TOOLS_BY_NAME[tool].schema
    pool, where = bases(schema), paths(schema)
    fresh = [fitting(sub) for _, sub in where]

    @st.composite
    def draw_text(draw: st.DrawFn) -> str:
        if draw(st.integers(0, 9)) == 0:
            return draw(st.one_of(pick(TEXT_JUNK), short_text, anything_text))
        value: Any = draw(pick(pool))
        for _ in range((0, 1, 1, 1, 2, 3)[draw(st.integers(0, 5))]):
            index = draw(st.integers(0, len(where) - 1))
            how = draw(st.integers(0, 9))
            if how == 0:
                new: Any = DELETE
            elif how <= 5:
                new = draw(fresh[index])
            else:
                new = draw(mutation_value)
            value = mutate(value, where[index][0], new)
        return to_text(value)

    return draw_text()


USERS = st.sampled_from(["alice", "alice", "alice", "bob"])


def example(family: str) -> st.SearchStrategy[tuple[str, str, str]]:
    """(tool, user, argument text) for a tool of ``family``; built once per family."""
    return st.one_of(
        [st.tuples(st.just(tool), USERS, argument_text(tool)) for tool in FAMILIES[family]]
    )


# --------------------------------------------------------------------------- the rig


@dataclass
class Rig:
    stack: DevStack
    runner: ToolRunner
    ids: itertools.count[int]
    #: Inputs already checked: Hypothesis often reaches the same text by different draws
    #: (``{}`` for list_skills above all), and one backend call per input is enough.
    checked: set[tuple[str, str, str]] = field(default_factory=set)

    async def check(self, tool: str, user: str, text: str) -> None:
        if (tool, user, text) in self.checked:
            event("an input seen before")
            return
        self.checked.add((tool, user, text))
        self.stack.call_log.clear()
        acting = Acting(
            human_id=user, organization_id="acme", token=self.stack.token(user), session_id="fuzz"
        )
        context = ToolContext(acting=acting, project_id="demo", reserve_write=lambda: True)
        call = ToolCall(call_id=f"fuzz-{next(self.ids)}", name=tool, arguments=text)
        outcome = await self.runner.run(call, context)
        encoded = outcome.content.encode("utf-8")
        document = json.loads(encoded)
        assert len(encoded) <= MAX_RESULT_BYTES
        if outcome.is_error:
            assert outcome.error_reason in EXPLAINED, (tool, text[:300], outcome.content)
            assert document["error"]["reason"] == outcome.error_reason
            event(f"{tool} {outcome.error_reason}")
        else:
            event(f"{tool} ok")
        bugs = [r for r in self.stack.calls if r.code in BUG_CODES]
        assert not bugs, (tool, text[:300], bugs)


@pytest.fixture(scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    stack = await DevStack.start(
        DevStackConfig(data_dir=tmp_path_factory.mktemp("fuzz"), address="127.0.0.1:0")
    )
    channel = make_channel(stack.address, tls=None, insecure=False)
    backends = GrpcToolBackends(
        tracker=channel,
        skills=channel,
        knowledge=channel,
        # One credential per backend, each for its own audience.
        tracker_credential=lambda: stack.planner_credential(TRACKER_AUDIENCE),
        skills_credential=lambda: stack.planner_credential(SKILLS_AUDIENCE),
        knowledge_credential=lambda: stack.planner_credential(KNOWLEDGE_AUDIENCE),
    )
    try:
        yield Rig(stack, ToolRunner(backends, timeout_s=10.0), itertools.count())
    finally:
        await channel.close()
        await stack.stop(None)


FUZZ = settings(
    max_examples=EXAMPLES_PER_FAMILY,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(drawn=example("tracker"))
async def test_tracker_tool_arguments(rig: Rig, drawn: tuple[str, str, str]) -> None:
    await rig.check(*drawn)


@FUZZ
@given(drawn=example("skills"))
async def test_skills_tool_arguments(rig: Rig, drawn: tuple[str, str, str]) -> None:
    await rig.check(*drawn)


@FUZZ
@given(drawn=example("knowledge"))
async def test_knowledge_tool_arguments(rig: Rig, drawn: tuple[str, str, str]) -> None:
    await rig.check(*drawn)


def test_the_families_are_every_tool() -> None:
    assert sorted(name for names in FAMILIES.values() for name in names) == sorted(TOOLS_BY_NAME)
