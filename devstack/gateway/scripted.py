"""The `scripted` provider: a test double with a contract.

A scenario is JSON: ``{"rules": [RULE, ...]}`` or a bare list of rules. The provider is
stateless: for each request the first rule whose ``match`` fits wins and its ``reply`` is
streamed. Every key below is checked when the scenario is loaded; an unknown key or a
wrong type is a `ScenarioError` naming the rule index (from 0) and the key.

RULE: ``{"match": MATCH, "reply": REPLY, "comment": str}``; ``match`` and ``comment`` are
optional. A scenario object may also carry a top-level ``comment``.

MATCH (all keys optional; an absent key matches anything):

- ``purpose``: ``"turn"`` or ``"compaction"``.
- ``last_role``: ``"human"`` or ``"tool"``, the role of the last message (proto user =
  human).
- ``last_text_regex``: Python `re.search` pattern against the last text: the last
  message's text, or for a tool message its result content; for a compaction request the
  last human message's text.
- ``tool_name``: the name of the last tool result in the request (its ToolResult.name,
  or else the name of the call it answers).
- ``tool_results_in_turn``: the number of tool messages after the latest human message
  (all of them when there is none).

REPLY (all keys optional; ``{}`` is an empty answer that finishes with STOP):

- ``text``: the answer's text.
- ``chunk_chars``: split ``text`` into deltas of this many characters (>= 1); default
  one delta with the whole text.
- ``tool_calls``: a list of ``{"name": str, "arguments": OBJECT}`` (sent as compact JSON)
  or ``{"name": str, "raw_arguments": str}`` (sent verbatim, possibly invalid JSON);
  neither means ``{}``. Each call gets a fresh id ``call_<24 hex>``, or ``"id": str``
  (e.g. the same id for two calls, as some providers send). An empty ``name`` plays a
  model that sent a call without one.
- ``usage``: ``{"input_tokens": int, "output_tokens": int}``; absent means no usage is
  reported.
- ``delay_ms``: milliseconds slept before each delta, before a scripted error, and before
  the tool calls and finish when there is no text.
- ``error``: ``{"code": "UNAVAILABLE", "message": str, "reason": str,
  "retry_after_ms": int}``: fail with that gRPC status code name (not OK); ``reason``
  becomes the ErrorInfo reason (default: the code name), ``retry_after_ms`` a RetryInfo.
- ``error_after_deltas``: with ``error``: stream that many deltas first (at most all of
  them), then fail. Without it the error comes before any delta.
- ``reasoning``: reasoning text streamed before the answer, as reasoning activity (split
  by ``chunk_chars`` like the text), e.g. to play a model that thinks for a long time
  (with ``delay_ms``) before its first token.
- ``refusal``: a refusal streamed after ``text`` (split by ``chunk_chars``); the finish
  is REFUSAL.
- ``argument_chunk_chars``: stream each tool call as a start and argument fragments of
  this many characters (>= 1), ``delay_ms`` before each, instead of whole.
- ``finish_reason``: ``stop``, ``tool_calls``, ``length``, ``content_filter``,
  ``refusal`` or ``truncated``: the finish to report instead of the one implied (a
  ``length`` with tool calls plays a model cut inside its arguments: the gateway sends
  no complete calls).
- ``truncate_after_deltas``: stream that many deltas (at most all of them), then end as
  a provider whose stream stopped without a finish reason (finish TRUNCATED; no
  complete calls). Not with ``error``.

Deltas, in the order they are streamed: the reasoning pieces, the text pieces, the
refusal pieces, then the tool calls: with ``argument_chunk_chars`` each call's start and
its argument fragments, else each whole call as one. ``delay_ms`` is slept before each
reasoning, text, refusal and argument delta and before each streamed call's start; whole
calls are preceded by one sleep only when nothing was streamed before them.

Substitutions, in ``text``, ``raw_arguments`` and the string values of ``arguments``
(nested ones included; in ``arguments`` the substituted value is JSON-escaped):

- ``{{tool_result}}``: the last tool result's content, cut to 400 characters (ending
  with "…" when cut); empty when the request has no tool result.
- ``{{tool_result_lines}}``: the same result for a human to read: a JSON object's list
  (``items``, ``entries``, ...) one element a line, ``- ID: TITLE (key value, ...)``,
  its other fields as ``key: value`` lines; at most 12 lines of at most 160 characters
  (the rest counted); text that is not JSON as it is, cut as above. An extension: the
  demo scenario's answers read as answers, not raw JSON.
- ``{{match:N}}`` / ``{{match:NAME}}``: group N (0 = the whole match) or the named group of
  this rule's ``last_text_regex`` match; empty when the group did not participate. An
  extension, so that a rule can pass an id from the human's question
  to a tool; a rule using it must have ``last_text_regex`` with that group.

The finish reason is ``finish_reason`` when given, else REFUSAL with a refusal,
TOOL_CALLS when the reply has tool calls, else STOP. When no rule
matches, the call fails with FAILED_PRECONDITION (ErrorInfo reason ``NO_MATCHING_RULE``)
whose message names the request: purpose, last role, start of the last text.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import math
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeAlias

import grpc
from ballet.llm.v1 import gateway_pb2

from devstack.gateway.base import (
    FinishChunk,
    FinishReason,
    ProviderChunk,
    ProviderError,
    ReasoningChunk,
    TextChunk,
    ToolCallChunk,
    ToolCallDeltaChunk,
    ToolCallStartChunk,
    Usage,
    new_tool_call_id,
)

TOOL_RESULT_MAX_CHARS = 400
"""How much of a tool result `{{tool_result}}` shows before cutting with an ellipsis."""

REASON_NO_MATCHING_RULE = "NO_MATCHING_RULE"
REASON_SCENARIO_INVALID = "SCENARIO_INVALID"

JsonValue: TypeAlias = bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"] | None
Sleep: TypeAlias = Callable[[float], Awaitable[None]]
HumanOrTool: TypeAlias = Literal["human", "tool"]

_RULE_KEYS = frozenset({"match", "reply", "comment"})
_MATCH_KEYS = frozenset(
    {"purpose", "last_role", "last_text_regex", "tool_name", "tool_results_in_turn"}
)
_REPLY_KEYS = frozenset(
    {
        "text",
        "chunk_chars",
        "tool_calls",
        "usage",
        "delay_ms",
        "error",
        "error_after_deltas",
        "reasoning",
        "refusal",
        "argument_chunk_chars",
        "finish_reason",
        "truncate_after_deltas",
    }
)
_FINISH_NAMES: Mapping[str, FinishReason] = {
    reason.value: reason for reason in FinishReason if reason is not FinishReason.UNSPECIFIED
}
_TOOL_CALL_KEYS = frozenset({"name", "arguments", "raw_arguments", "id"})
_USAGE_KEYS = frozenset({"input_tokens", "output_tokens"})
_ERROR_KEYS = frozenset({"code", "message", "reason", "retry_after_ms"})
_PURPOSES: Mapping[str, int] = {
    "turn": gateway_pb2.PURPOSE_TURN,
    "compaction": gateway_pb2.PURPOSE_COMPACTION,
}
_PLACEHOLDER = re.compile(r"\{\{\s*([a-z_]+)(?::([A-Za-z0-9_]+))?\s*\}\}")

# Timestamps of some file systems tick coarsely (a jiffy on ext4, 2 s on FAT), so a file
# rewritten twice within one tick can keep its mtime. As in git's "racy clean" check, a
# file modified this recently is compared by content instead of trusting its stat data.
_RACY_WINDOW_NS = 2_000_000_000


class ScenarioError(ValueError):
    """A scenario is not valid; the message names the source, the rule index and the key."""


# --- the scenario model -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Match:
    """The conditions of one rule; None matches anything."""

    purpose: int | None = None
    last_role: HumanOrTool | None = None
    last_text_regex: re.Pattern[str] | None = None
    tool_name: str | None = None
    tool_results_in_turn: int | None = None


@dataclass(frozen=True, slots=True)
class ScriptedToolCall:
    """One tool call of a reply: either a JSON object or a literal arguments string."""

    name: str
    arguments: dict[str, JsonValue] | None = None
    raw_arguments: str | None = None
    id: str | None = None


@dataclass(frozen=True, slots=True)
class ScriptedError:
    """The failure a reply ends with."""

    code: grpc.StatusCode
    message: str
    reason: str | None = None
    retry_after_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    """What a rule answers; see the module docstring for each key."""

    text: str = ""
    chunk_chars: int | None = None
    tool_calls: tuple[ScriptedToolCall, ...] = ()
    usage: Usage | None = None
    delay_ms: float = 0.0
    error: ScriptedError | None = None
    error_after_deltas: int = 0
    reasoning: str = ""
    refusal: str = ""
    argument_chunk_chars: int | None = None
    finish_reason: FinishReason | None = None
    truncate_after_deltas: int | None = None


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule; `index` is its position in the scenario, from 0."""

    index: int
    match: Match
    reply: Reply


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What the match keys look at, computed once per request."""

    purpose: int
    last_role: str
    last_text: str
    last_tool_name: str | None
    last_tool_content: str | None
    tool_results_in_turn: int

    @classmethod
    def of(cls, request: gateway_pb2.GenerateRequest) -> RequestFacts:
        """Read the facts of a request (see the module docstring for each one)."""
        messages = request.messages
        last_role = "none"
        last_text = ""
        if messages:
            last = messages[-1]
            last_role = _role_name(last.role)
            is_tool = last.role == gateway_pb2.ROLE_TOOL
            last_text = last.tool_result.content if is_tool else last.text
        latest_human = -1
        for i in range(len(messages) - 1, -1, -1):
            if messages[i].role == gateway_pb2.ROLE_USER:
                latest_human = i
                break
        if request.purpose == gateway_pb2.PURPOSE_COMPACTION:
            last_text = messages[latest_human].text if latest_human >= 0 else ""
        in_turn = sum(1 for m in messages[latest_human + 1 :] if m.role == gateway_pb2.ROLE_TOOL)
        tool_name: str | None = None
        tool_content: str | None = None
        for i in range(len(messages) - 1, -1, -1):
            message = messages[i]
            if message.role == gateway_pb2.ROLE_TOOL:
                result = message.tool_result
                tool_content = result.content
                tool_name = result.name or _called_name(messages[:i], result.tool_call_id)
                break
        return cls(
            purpose=request.purpose,
            last_role=last_role,
            last_text=last_text,
            last_tool_name=tool_name,
            last_tool_content=tool_content,
            tool_results_in_turn=in_turn,
        )

    def describe(self) -> str:
        """A one-line description for error messages: purpose, last role, text start."""
        purpose = _purpose_name(self.purpose)
        start = self.last_text[:80] + ("…" if len(self.last_text) > 80 else "")
        return (
            f"purpose={purpose}, last_role={self.last_role}, last_text={start!r}, "
            f"tool_name={self.last_tool_name!r}, tool_results_in_turn={self.tool_results_in_turn}"
        )


def _role_name(role: int) -> str:
    if role == gateway_pb2.ROLE_USER:
        return "human"
    if role == gateway_pb2.ROLE_TOOL:
        return "tool"
    if role == gateway_pb2.ROLE_ASSISTANT:
        return "assistant"
    return "unspecified"


def _purpose_name(purpose: int) -> str:
    for name, value in _PURPOSES.items():
        if value == purpose:
            return name
    return "unspecified"


def _called_name(earlier: Sequence[gateway_pb2.Message], call_id: str) -> str | None:
    for message in reversed(earlier):
        for call in message.tool_calls:
            if call.id == call_id:
                return call.name
    return None


@dataclass(frozen=True, slots=True)
class Scenario:
    """A validated scenario: an ordered tuple of rules."""

    rules: tuple[Rule, ...]
    source: str = "<scenario>"

    @classmethod
    def parse(cls, data: object, *, source: str = "<scenario>") -> Scenario:
        """Validate JSON-shaped data (a dict with `rules`, or a list of rules).

        Raises:
            ScenarioError: naming `source`, the rule index and the offending key.
        """
        return _Parser(source).scenario(data)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Scenario:
        """Read and validate a scenario file (UTF-8 JSON).

        Raises:
            ScenarioError: the file is missing, not JSON, or not a valid scenario.
        """
        source = os.fspath(path)
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise ScenarioError(f"{source}: cannot read the scenario: {exc}") from exc
        return cls.parse_json(raw, source=source)

    @classmethod
    def parse_json(cls, raw: bytes | str, *, source: str = "<scenario>") -> Scenario:
        """Parse and validate scenario JSON text.

        Raises:
            ScenarioError: the text is not JSON or not a valid scenario.
        """
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ScenarioError(f"{source}: not valid JSON: {exc}") from exc
        return cls.parse(data, source=source)

    def first_match(self, facts: RequestFacts) -> tuple[Rule, re.Match[str] | None] | None:
        """The first rule whose match fits, with its regex match (None without a regex)."""
        for rule in self.rules:
            m = rule.match
            if m.purpose is not None and m.purpose != facts.purpose:
                continue
            if m.last_role is not None and m.last_role != facts.last_role:
                continue
            if m.tool_name is not None and m.tool_name != facts.last_tool_name:
                continue
            if (
                m.tool_results_in_turn is not None
                and m.tool_results_in_turn != facts.tool_results_in_turn
            ):
                continue
            found: re.Match[str] | None = None
            if m.last_text_regex is not None:
                found = m.last_text_regex.search(facts.last_text)
                if found is None:
                    continue
            return rule, found
        return None


# --- validation ---------------------------------------------------------------------------


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str) -> ScenarioError:
        return ScenarioError(f"{self.source}: {where}: {problem}")

    def scenario(self, data: object) -> Scenario:
        if isinstance(data, dict):
            self.keys("the scenario", data, frozenset({"rules", "comment"}))
            if "rules" not in data:
                raise self.fail("the scenario", "missing key 'rules'")
            rules = data["rules"]
        else:
            rules = data
        if not isinstance(rules, list):
            raise self.fail("the scenario", 'expected a list of rules or {"rules": [...]}')
        return Scenario(
            rules=tuple(self.rule(i, raw) for i, raw in enumerate(rules)), source=self.source
        )

    def keys(self, where: str, data: Mapping[str, object], allowed: frozenset[str]) -> None:
        for key in data:
            if key not in allowed:
                raise self.fail(
                    where, f"unknown key {key!r} (allowed: {', '.join(sorted(allowed))})"
                )

    def obj(self, where: str, value: object) -> dict[str, object]:
        if not isinstance(value, dict):
            raise self.fail(where, f"expected an object, got {type(value).__name__}")
        return value

    def rule(self, index: int, raw: object) -> Rule:
        where = f"rule {index}"
        data = self.obj(where, raw)
        self.keys(where, data, _RULE_KEYS)
        if "reply" not in data:
            raise self.fail(where, "missing key 'reply'")
        if not isinstance(data.get("comment", ""), str):
            raise self.fail(f"{where}: comment", "expected a string")
        match = self.match(index, data.get("match", {}))
        reply = self.reply(index, data["reply"], match)
        return Rule(index=index, match=match, reply=reply)

    def match(self, index: int, raw: object) -> Match:
        where = f"rule {index}: match"
        data = self.obj(where, raw)
        self.keys(where, data, _MATCH_KEYS)
        purpose: int | None = None
        if "purpose" in data:
            value = data["purpose"]
            if not isinstance(value, str) or value not in _PURPOSES:
                raise self.fail(
                    f"{where}.purpose", f"expected 'turn' or 'compaction', got {value!r}"
                )
            purpose = _PURPOSES[value]
        last_role: HumanOrTool | None = None
        if "last_role" in data:
            value = data["last_role"]
            if value == "human":
                last_role = "human"
            elif value == "tool":
                last_role = "tool"
            else:
                raise self.fail(f"{where}.last_role", f"expected 'human' or 'tool', got {value!r}")
        regex: re.Pattern[str] | None = None
        if "last_text_regex" in data:
            value = self.string(f"{where}.last_text_regex", data["last_text_regex"])
            try:
                regex = re.compile(value)
            except re.error as exc:
                raise self.fail(f"{where}.last_text_regex", f"invalid regex: {exc}") from exc
        tool_name: str | None = None
        if "tool_name" in data:
            tool_name = self.string(f"{where}.tool_name", data["tool_name"])
        in_turn: int | None = None
        if "tool_results_in_turn" in data:
            in_turn = self.integer(f"{where}.tool_results_in_turn", data["tool_results_in_turn"])
        return Match(purpose, last_role, regex, tool_name, in_turn)

    def reply(self, index: int, raw: object, match: Match) -> Reply:
        where = f"rule {index}: reply"
        data = self.obj(where, raw)
        self.keys(where, data, _REPLY_KEYS)
        text = ""
        if "text" in data:
            text = self.string(f"{where}.text", data["text"])
            self.placeholders(f"{where}.text", text, match)
        chunk_chars: int | None = None
        if "chunk_chars" in data:
            chunk_chars = self.integer(f"{where}.chunk_chars", data["chunk_chars"], minimum=1)
        calls: list[ScriptedToolCall] = []
        if "tool_calls" in data:
            raw_calls = data["tool_calls"]
            if not isinstance(raw_calls, list):
                raise self.fail(f"{where}.tool_calls", "expected a list")
            calls = [
                self.tool_call(f"{where}.tool_calls[{i}]", c, match)
                for i, c in enumerate(raw_calls)
            ]
        usage: Usage | None = None
        if "usage" in data:
            usage_data = self.obj(f"{where}.usage", data["usage"])
            self.keys(f"{where}.usage", usage_data, _USAGE_KEYS)
            usage = Usage(
                input_tokens=self.integer(
                    f"{where}.usage.input_tokens", usage_data.get("input_tokens", 0)
                ),
                output_tokens=self.integer(
                    f"{where}.usage.output_tokens", usage_data.get("output_tokens", 0)
                ),
            )
        delay_ms = 0.0
        if "delay_ms" in data:
            value = data["delay_ms"]
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise self.fail(f"{where}.delay_ms", f"expected a number >= 0, got {value!r}")
            delay_ms = float(value)
        error: ScriptedError | None = None
        if "error" in data:
            error = self.error(f"{where}.error", data["error"])
        after = 0
        if "error_after_deltas" in data:
            if error is None:
                raise self.fail(f"{where}.error_after_deltas", "needs 'error' in the same reply")
            after = self.integer(f"{where}.error_after_deltas", data["error_after_deltas"])
        extra = self.streaming(where, data, match)
        if error is not None and extra.truncate_after_deltas is not None:
            raise self.fail(f"{where}.truncate_after_deltas", "give 'error' or this, not both")
        return Reply(
            text=text,
            chunk_chars=chunk_chars,
            tool_calls=tuple(calls),
            usage=usage,
            delay_ms=delay_ms,
            error=error,
            error_after_deltas=after,
            reasoning=extra.reasoning,
            refusal=extra.refusal,
            argument_chunk_chars=extra.argument_chunk_chars,
            finish_reason=extra.finish_reason,
            truncate_after_deltas=extra.truncate_after_deltas,
        )

    def streaming(self, where: str, data: Mapping[str, object], match: Match) -> Reply:
        """The reply keys that shape the stream (reasoning, refusal, argument streaming,
        finish reason, truncation), as a partial ``Reply``."""
        texts: dict[str, str] = {}
        for key in ("reasoning", "refusal"):
            if key in data:
                texts[key] = self.string(f"{where}.{key}", data[key])
                self.placeholders(f"{where}.{key}", texts[key], match)
        argument_chunk_chars: int | None = None
        if "argument_chunk_chars" in data:
            argument_chunk_chars = self.integer(
                f"{where}.argument_chunk_chars", data["argument_chunk_chars"], minimum=1
            )
        finish: FinishReason | None = None
        if "finish_reason" in data:
            name = data["finish_reason"]
            if not isinstance(name, str) or name not in _FINISH_NAMES:
                raise self.fail(
                    f"{where}.finish_reason",
                    f"expected one of {', '.join(sorted(_FINISH_NAMES))}, got {name!r}",
                )
            finish = _FINISH_NAMES[name]
        truncate: int | None = None
        if "truncate_after_deltas" in data:
            truncate = self.integer(f"{where}.truncate_after_deltas", data["truncate_after_deltas"])
        return Reply(
            reasoning=texts.get("reasoning", ""),
            refusal=texts.get("refusal", ""),
            argument_chunk_chars=argument_chunk_chars,
            finish_reason=finish,
            truncate_after_deltas=truncate,
        )

    def tool_call(self, where: str, raw: object, match: Match) -> ScriptedToolCall:
        data = self.obj(where, raw)
        self.keys(where, data, _TOOL_CALL_KEYS)
        if "name" not in data:
            raise self.fail(where, "missing key 'name'")
        name = self.string(f"{where}.name", data["name"])
        call_id = self.string(f"{where}.id", data["id"]) if "id" in data else None
        if "arguments" in data and "raw_arguments" in data:
            raise self.fail(where, "give 'arguments' or 'raw_arguments', not both")
        if "raw_arguments" in data:
            raw_arguments = self.string(f"{where}.raw_arguments", data["raw_arguments"])
            self.placeholders(f"{where}.raw_arguments", raw_arguments, match)
            return ScriptedToolCall(name=name, raw_arguments=raw_arguments, id=call_id)
        arguments = data.get("arguments", {})
        if not isinstance(arguments, dict):
            raise self.fail(f"{where}.arguments", "expected a JSON object")
        for text in _strings_in(arguments):
            self.placeholders(f"{where}.arguments", text, match)
        return ScriptedToolCall(name=name, arguments=arguments, id=call_id)

    def error(self, where: str, raw: object) -> ScriptedError:
        data = self.obj(where, raw)
        self.keys(where, data, _ERROR_KEYS)
        for key in ("code", "message"):
            if key not in data:
                raise self.fail(where, f"missing key {key!r}")
        code_name = self.string(f"{where}.code", data["code"])
        code = getattr(grpc.StatusCode, code_name, None)
        if not isinstance(code, grpc.StatusCode) or code == grpc.StatusCode.OK:
            raise self.fail(
                f"{where}.code",
                f"expected a gRPC status code name other than OK, got {code_name!r}",
            )
        message = self.string(f"{where}.message", data["message"])
        reason: str | None = None
        if "reason" in data:
            reason = self.string(f"{where}.reason", data["reason"])
        retry_after_ms: int | None = None
        if "retry_after_ms" in data:
            retry_after_ms = self.integer(f"{where}.retry_after_ms", data["retry_after_ms"])
        return ScriptedError(code, message, reason, retry_after_ms)

    def string(self, where: str, value: object) -> str:
        if not isinstance(value, str):
            raise self.fail(where, f"expected a string, got {type(value).__name__}")
        return value

    def integer(self, where: str, value: object, *, minimum: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(where, f"expected an integer >= {minimum}, got {value!r}")
        return value

    def placeholders(self, where: str, text: str, match: Match) -> None:
        for found in _PLACEHOLDER.finditer(text):
            name, group = found.group(1), found.group(2)
            if name in ("tool_result", "tool_result_lines") and group is None:
                continue
            if name != "match" or group is None:
                raise self.fail(
                    where,
                    f"unknown placeholder {found.group(0)!r} "
                    "(known: {{tool_result}}, {{tool_result_lines}}, {{match:N}}, {{match:NAME}})",
                )
            regex = match.last_text_regex
            if regex is None:
                raise self.fail(where, f"{found.group(0)} needs 'last_text_regex' in the match")
            if group.isdigit():
                if int(group) > regex.groups:
                    raise self.fail(
                        where, f"{found.group(0)}: the regex has only {regex.groups} group(s)"
                    )
            elif group not in regex.groupindex:
                raise self.fail(where, f"{found.group(0)}: the regex has no group named {group!r}")


def _strings_in(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings_in(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings_in(v)]
    return []


# --- answering ----------------------------------------------------------------------------


def _cut(text: str) -> str:
    if len(text) <= TOOL_RESULT_MAX_CHARS:
        return text
    return text[: TOOL_RESULT_MAX_CHARS - 1] + "…"


#: How many lines ``{{tool_result_lines}}`` shows, and how long each may be.
RESULT_LINES = 12
RESULT_LINE_CHARS = 160


def readable_result(content: str) -> str:
    """A tool result for a human (``{{tool_result_lines}}``): the elements of a JSON
    object's list one a line, its other fields ``key: value`` (an object too long for one
    line, such as an item with its description, a field a line); each line cut at a word
    to ``RESULT_LINE_CHARS``; text that is not a JSON object as it is (cut to
    ``TOOL_RESULT_MAX_CHARS``)."""
    try:
        value = json.loads(content)
    except ValueError:
        return _cut(content)
    if not isinstance(value, dict):
        return _cut(content)
    lines: list[str] = []
    for key, field_value in value.items():
        if isinstance(field_value, list):
            lines.extend(f"- {_one_line(element)}" for element in field_value)
            if not field_value:
                lines.append(f"(no {key})")
        elif isinstance(field_value, dict):
            line = f"{key.replace('_', ' ')}: {_one_line(field_value)}"
            head, details = _parts(field_value)
            if len(line) > RESULT_LINE_CHARS and head:
                # Too long for one line (an item with its description): its fields one a
                # line, so that each is cut on its own, at a word.
                lines.append(f"{key.replace('_', ' ')}: {head}")
                lines.extend(f"  {name}: {value}" for name, value in details)
            else:
                lines.append(line)
            # Its own lists: objects (a changeset's operations) one a line below it, plain
            # values (an item's blockers) on one line with their name.
            for name, inner in field_value.items():
                if not isinstance(inner, list) or not inner:
                    continue
                if all(isinstance(element, dict) for element in inner):
                    lines.extend(f"  - {_one_line(element)}" for element in inner)
                else:
                    plain = ", ".join(str(element) for element in inner)
                    lines.append(f"  {name.replace('_', ' ')}: {plain}")
        elif field_value not in (None, ""):
            lines.append(f"{key.replace('_', ' ')}: {field_value}")
    if len(lines) > RESULT_LINES:
        lines = [*lines[: RESULT_LINES - 1], f"(and {len(lines) - RESULT_LINES + 1} more)"]
    return "\n".join(_cut_line(line) for line in lines)


def _one_line(element: object) -> str:
    """``PAN-4: Pantry inventory (kind epic, state open, priority 1)`` for an object with
    an id and a title or name; its fields ``key value`` otherwise."""
    if not isinstance(element, dict):
        return json.dumps(element, ensure_ascii=False)
    if len(element) == 1:
        # {"create_item": {...}}: what it does, then what it is.
        ((key, inner),) = element.items()
        if isinstance(inner, dict):
            return f"{key.replace('_', ' ')}: {_one_line(inner)}"
    head, fields = _parts(element)
    details = ", ".join(f"{name} {value}" for name, value in fields)
    if not head:
        return details or json.dumps(element, ensure_ascii=False)
    return f"{head} ({details})" if details else head


def _parts(element: dict[str, object]) -> tuple[str, list[tuple[str, object]]]:
    """``("PAN-4: Pantry inventory", [("kind", "epic"), ...])``: an object's id and title
    or name (empty when it has neither), and its other plain fields, named for a
    human."""
    rest = dict(element)
    ident = next((rest.pop(k) for k in list(rest) if k == "id" or k.endswith("_id")), None)
    title = next((rest.pop(k) for k in ("title", "name", "summary") if k in rest), None)
    fields: list[tuple[str, object]] = [
        (k.replace("_", " "), v)
        for k, v in rest.items()
        if isinstance(v, str | int | float) and not isinstance(v, bool) and v != ""
    ]
    head = ": ".join(str(part) for part in (ident, title) if part not in (None, ""))
    return head, fields


def _cut_line(line: str) -> str:
    """``line`` whole, or cut to ``RESULT_LINE_CHARS`` with an ellipsis, at the last space
    when one is in the last third (a word is not cut in two)."""
    line = " ".join(line.split("\n")) if "\n" in line else line
    if len(line) <= RESULT_LINE_CHARS:
        return line
    kept = line[: RESULT_LINE_CHARS - 1]
    space = kept.rfind(" ")
    if space >= RESULT_LINE_CHARS * 2 // 3:
        kept = kept[:space].rstrip(" ,;:")
    return kept + "…"


class _Substitution:
    def __init__(self, tool_result: str | None, found: re.Match[str] | None) -> None:
        self.tool_result = _cut(tool_result or "")
        self.tool_result_lines = readable_result(tool_result) if tool_result else ""
        self.found = found

    def __call__(self, text: str) -> str:
        return _PLACEHOLDER.sub(self.replace, text)

    def replace(self, placeholder: re.Match[str]) -> str:
        if placeholder.group(1) == "tool_result":
            return self.tool_result
        if placeholder.group(1) == "tool_result_lines":
            return self.tool_result_lines
        group = placeholder.group(2)
        if self.found is None:
            return ""
        value = self.found.group(int(group) if group.isdigit() else group)
        return value or ""

    def walk(self, value: JsonValue) -> JsonValue:
        if isinstance(value, str):
            return self(value)
        if isinstance(value, dict):
            return {k: self.walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.walk(v) for v in value]
        return value


def _split(text: str, chunk_chars: int | None) -> list[str]:
    if not text:
        return []
    if chunk_chars is None:
        return [text]
    return [text[i : i + chunk_chars] for i in range(0, len(text), chunk_chars)]


class _ScenarioFile:
    """A scenario file re-read when it changes (see `_RACY_WINDOW_NS` for why content too)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stat_key: tuple[int, int, int] | None = None
        self.content: bytes | None = None
        self.scenario: Scenario | None = None
        self.error: ScenarioError | None = None
        self.refresh()

    def refresh(self, *, force: bool = False) -> None:
        try:
            st = self.path.stat()
        except OSError as exc:
            self.error = ScenarioError(f"{self.path}: cannot read the scenario: {exc}")
            self.stat_key = None
            self.content = None
            return
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        racy = time.time_ns() - st.st_mtime_ns < _RACY_WINDOW_NS
        if not force and key == self.stat_key and not racy:
            return
        try:
            content = self.path.read_bytes()
        except OSError as exc:
            self.error = ScenarioError(f"{self.path}: cannot read the scenario: {exc}")
            self.stat_key = None
            self.content = None
            return
        self.stat_key = key
        if not force and content == self.content:
            return
        self.content = content
        try:
            self.scenario = Scenario.parse_json(content, source=str(self.path))
            self.error = None
        except ScenarioError as exc:
            self.error = exc

    def current(self) -> Scenario:
        self.refresh()
        if self.error is not None:
            raise self.error
        assert self.scenario is not None
        return self.scenario


ScenarioData: TypeAlias = Scenario | Mapping[str, object] | Sequence[object]


class ScriptedProvider:
    """The `scripted` provider, from an in-memory scenario or a file.

    Args:
        scenario: a `Scenario`, or JSON-shaped data (a dict with `rules`, or a list of
            rules) validated here.
        sleep: the coroutine used for `delay_ms` (seconds); tests may pass their own.
        name: the model it says answered, on every finish (`Finish.model`, as a real
            server names its model or file); empty: none.

    Raises:
        ScenarioError: the scenario data is not valid.
    """

    def __init__(
        self, scenario: ScenarioData, *, sleep: Sleep = asyncio.sleep, name: str = ""
    ) -> None:
        self._scenario = _as_scenario(scenario)
        self._file: _ScenarioFile | None = None
        self._sleep = sleep
        self._name = name

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], *, sleep: Sleep = asyncio.sleep, name: str = ""
    ) -> ScriptedProvider:
        """A provider reading a scenario file, re-read on each request when it changed.

        The file is checked at every request (one `stat`, and a read when it may have
        changed), so a test can rewrite the scenario of a running devstack. A rewritten
        file that is not valid makes each request fail with FAILED_PRECONDITION (reason
        `SCENARIO_INVALID`) until it is fixed.

        Raises:
            ScenarioError: the file is missing or not valid at start.
        """
        scenario_file = _ScenarioFile(Path(path))
        initial = scenario_file.current()
        provider = cls(initial, sleep=sleep, name=name)
        provider._file = scenario_file
        return provider

    @property
    def scenario(self) -> Scenario:
        """The scenario in use (for a file: as last loaded).

        Raises:
            ScenarioError: the scenario file is currently missing or not valid.
        """
        if self._file is not None:
            self._scenario = self._file.current()
        return self._scenario

    def set_scenario(self, scenario: ScenarioData) -> None:
        """Replace the scenario; a file-backed provider stops reading its file.

        Raises:
            ScenarioError: the scenario data is not valid.
        """
        self._scenario = _as_scenario(scenario)
        self._file = None

    def reload(self) -> None:
        """Re-read the scenario file now, whatever its stat data says.

        Raises:
            ScenarioError: the file is missing or not valid (the previous rules stay).
        """
        if self._file is None:
            return
        self._file.refresh(force=True)
        self._scenario = self._file.current()

    async def generate(self, request: gateway_pb2.GenerateRequest) -> AsyncIterator[ProviderChunk]:
        """Answer from the first matching rule (see the module docstring).

        Raises:
            ProviderError: FAILED_PRECONDITION when no rule matches or the scenario file
                is not valid; the rule's scripted error when its reply has one.
        """
        try:
            scenario = self.scenario
        except ScenarioError as exc:
            raise ProviderError(
                grpc.StatusCode.FAILED_PRECONDITION, str(exc), reason=REASON_SCENARIO_INVALID
            ) from exc
        facts = RequestFacts.of(request)
        found = scenario.first_match(facts)
        if found is None:
            raise ProviderError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no rule of scenario {scenario.source} matches the request ({facts.describe()})",
                reason=REASON_NO_MATCHING_RULE,
            )
        rule, regex_match = found
        reply = rule.reply
        substitute = _Substitution(facts.last_tool_content, regex_match)
        # Rendered before the first delta so that every call of the answer is complete.
        deltas = _deltas(reply, substitute)
        delay_s = reply.delay_ms / 1000.0
        stop = reply.error_after_deltas if reply.error is not None else reply.truncate_after_deltas
        for sent, (chunk, sleeps) in enumerate(deltas):
            if stop is not None and sent >= stop:
                break
            if delay_s and sleeps:
                await self._sleep(delay_s)
            yield chunk
        if reply.error is not None:
            if delay_s:
                await self._sleep(delay_s)
            error = reply.error
            raise ProviderError(
                error.code,
                error.message,
                reason=error.reason,
                retry_after_s=None if error.retry_after_ms is None else error.retry_after_ms / 1000,
            )
        if reply.truncate_after_deltas is not None:
            yield FinishChunk(FinishReason.TRUNCATED, reply.usage, model=self._name)
            return
        if not deltas and delay_s:
            await self._sleep(delay_s)
        reason = reply.finish_reason
        if reason is None:
            if reply.refusal:
                reason = FinishReason.REFUSAL
            elif reply.tool_calls:
                reason = FinishReason.TOOL_CALLS
            else:
                reason = FinishReason.STOP
        yield FinishChunk(reason=reason, usage=reply.usage, model=self._name)


def _deltas(reply: Reply, substitute: _Substitution) -> list[tuple[ProviderChunk, bool]]:
    """The streamed pieces of a reply in order, each with whether ``delay_ms`` is slept
    before it (see the module docstring)."""
    out: list[tuple[ProviderChunk, bool]] = []
    for piece in _split(substitute(reply.reasoning), reply.chunk_chars):
        out.append((ReasoningChunk(len(piece), piece), True))
    for piece in _split(substitute(reply.text), reply.chunk_chars):
        out.append((TextChunk(piece), True))
    for piece in _split(substitute(reply.refusal), reply.chunk_chars):
        out.append((TextChunk(piece), True))
    calls = [_render_call(call, substitute) for call in reply.tool_calls]
    if reply.argument_chunk_chars is None:
        first = not out
        for index, call in enumerate(calls):
            out.append((call, first and index == 0))
        return out
    for index, call in enumerate(calls):
        out.append((ToolCallStartChunk(index, call.id, call.name), True))
        for piece in _split(call.arguments, reply.argument_chunk_chars):
            out.append((ToolCallDeltaChunk(index, piece), True))
    return out


def _as_scenario(scenario: ScenarioData) -> Scenario:
    if isinstance(scenario, Scenario):
        return scenario
    # A Mapping/Sequence that is not a plain dict/list (e.g. a tuple) is copied first so
    # the parser sees JSON shapes only.
    if isinstance(scenario, Mapping) and not isinstance(scenario, dict):
        return Scenario.parse(dict(scenario))
    if isinstance(scenario, Sequence) and not isinstance(scenario, list | str):
        return Scenario.parse(list(scenario))
    return Scenario.parse(scenario)


def _render_call(call: ScriptedToolCall, substitute: _Substitution) -> ToolCallChunk:
    if call.raw_arguments is not None:
        arguments = substitute(call.raw_arguments)
    else:
        rendered = substitute.walk(call.arguments or {})
        arguments = json.dumps(rendered, separators=(",", ":"), ensure_ascii=False)
    call_id = call.id if call.id is not None else new_tool_call_id()
    return ToolCallChunk(id=call_id, name=call.name, arguments=arguments)


def demo_scenario_path() -> Path:
    """The built-in demo scenario shipped in `devstack.demo` (used by
    `ballet-planner dev` without `--scenario`)."""
    return Path(str(importlib.resources.files("devstack.demo").joinpath("scenario.json")))


def demo_provider(*, sleep: Sleep = asyncio.sleep) -> ScriptedProvider:
    """A scripted provider over the built-in demo scenario.

    Raises:
        ScenarioError: the shipped scenario is missing or invalid (a packaging bug).
    """
    # Loaded once (not re-read like --scenario files): the shipped file never changes.
    return ScriptedProvider(Scenario.load(demo_scenario_path()), sleep=sleep)
