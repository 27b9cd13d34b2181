"""Tool-call identity (docs/spec/turn-loop.md, Tool-call identity; decision 0111).

Real OpenAI-compatible servers do not give tool calls ids the planner can trust: several
number calls per answer (``call_0``, ``call_1``, ...) so every answer reuses the ids of
the one before, and some give every call the same id (``"0"``), within one answer too.
``ReusedIds`` is such a provider, wrapped around the scripted model behind the real
devstack gateway; the planner runs over real gRPC on SQLite. What is checked is what the
planner sent the model, what it sent the summarizer, what it stored and what reached the
tracker.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from ballet.llm.v1 import gateway_pb2
from ballet.planner.v1 import resources_pb2

from devstack.gateway.base import Provider, ProviderChunk, ToolCallChunk
from tests.service.turn_support import (
    Rig,
    error_reason,
    events,
    reset,
    start_rig,
    stop_rig,
    wait_for,
)

KIND = resources_pb2.MessageKind
END = resources_pb2.TurnEndReason
COMPACTION = gateway_pb2.PURPOSE_COMPACTION


class ReusedIds:
    """A provider double that ids tool calls the way some real servers do: ``per_answer``
    numbers them ``call_0``, ``call_1``, ... within each answer (so every answer reuses
    them); ``constant`` gives every call the id ``"0"``."""

    def __init__(self, inner: Provider, style: str) -> None:
        self._inner = inner
        self._style = style

    async def generate(self, request: gateway_pb2.GenerateRequest) -> AsyncIterator[ProviderChunk]:
        number = 0
        async for chunk in self._inner.generate(request):
            if isinstance(chunk, ToolCallChunk):
                reused = f"call_{number}" if self._style == "per_answer" else "0"
                chunk = dataclasses.replace(chunk, id=reused)
                number += 1
            yield chunk


def get_item(item_id: str) -> dict[str, Any]:
    return {"name": "get_item", "arguments": {"item_id": item_id}}


def propose(title: str) -> dict[str, Any]:
    operation = {"create_item": {"kind": "ticket", "title": f"{title} ticket", "epic_id": "PAN-4"}}
    return {"name": "propose_changeset", "arguments": {"title": title, "operations": [operation]}}


def human(regex: str, *calls: dict[str, Any]) -> dict[str, Any]:
    return {
        "match": {"purpose": "turn", "last_role": "human", "last_text_regex": regex},
        "reply": {"tool_calls": list(calls), "usage": {"input_tokens": 900, "output_tokens": 10}},
    }


RULES: list[dict[str, Any]] = [
    {
        "match": {"purpose": "compaction"},
        "reply": {"text": "SUMMARY of the earlier turns: the human read items, proposed A and B."},
    },
    human("^first$", get_item("PAN-5")),
    human("^propose A$", propose("Plan A")),
    human("^parallel$", get_item("PAN-6"), get_item("PAN-3")),
    human("^propose B$", propose("Plan B")),
    human("^slow$", get_item("PAN-7")),
    {
        "match": {"purpose": "turn", "last_role": "tool"},
        "reply": {"text": "Done.", "usage": {"input_tokens": 1500, "output_tokens": 10}},
    },
]
# Usage above the threshold after every answer: a compaction before each later turn.
SETTINGS = {"PLANNER__COMPACT_AT_TOKENS": "1000", "PLANNER__CANCEL_GRACE": "1"}


@pytest.fixture(scope="module")
async def module_rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    started = await start_rig(tmp_path_factory.mktemp("identity"), settings=SETTINGS)
    yield started
    await stop_rig(started)


@pytest.fixture(params=["per_answer", "constant"])
def rig(module_rig: Rig, request: pytest.FixtureRequest) -> Iterator[Rig]:
    reset(module_rig)
    module_rig.scenario(RULES)
    module_rig.gateway.provider = ReusedIds(module_rig.provider, request.param)
    yield module_rig
    module_rig.gateway.provider = module_rig.provider
    reset(module_rig)


def matches(call: Any, content: str) -> bool:
    """Whether a tool result's JSON is the result of ``call`` (its item or its title)."""
    arguments = json.loads(call.arguments)
    result = json.loads(content)
    if call.name == "get_item":
        return bool(result["item"]["item_id"] == arguments["item_id"])
    return bool(result["changeset"]["title"] == arguments["title"])


def assert_paired(request: gateway_pb2.GenerateRequest) -> int:
    """Every call of ``request`` is followed by its own result; returns the calls seen."""
    messages = list(request.messages)
    seen = 0
    for index, message in enumerate(messages):
        if message.role != gateway_pb2.ROLE_ASSISTANT or not message.tool_calls:
            continue
        calls = list(message.tool_calls)
        ids = [call.id for call in calls]
        assert len(set(ids)) == len(ids), f"ids repeated within one answer: {ids}"
        results = [m.tool_result for m in messages[index + 1 : index + 1 + len(calls)]]
        assert [r.tool_call_id for r in results] == ids
        for call, result in zip(calls, results, strict=True):
            assert matches(call, result.content), (call, result.content)
        seen += len(calls)
    return seen


async def test_reused_provider_ids_never_pair_a_call_with_another_calls_result(rig: Rig) -> None:
    session_id = ""
    for text in ("first", "propose A", "parallel", "propose B"):
        session_id, received = await rig.run_turn(text, session_id=session_id)
        ended = events(received, "turn_ended")[-1].turn_ended
        assert ended.reason == END.TURN_END_REASON_COMPLETED, ended

    # Every request the model was sent pairs each call with its own result.
    turn_requests = rig.requests()
    assert sum(assert_paired(request) for request in turn_requests[-2:]) >= 1
    for request in turn_requests:
        assert_paired(request)

    # The summarizer got each call followed by its own result, under ids used once.
    compactions = rig.requests(COMPACTION)
    assert compactions, "the test needs a compaction between the turns"
    for request in compactions:
        # The conversation is data in the summarizer's system prompt; a call and its
        # result are one block (decision 0172).
        conversation = request.system_prompt.split("<conversation>\n", 1)[1]
        blocks = conversation.rsplit("\n</conversation>", 1)[0].split("\n\n")
        calls = [b for b in blocks if b.startswith("Tool call ")]
        assert calls
        ids = [re.match(r"Tool call \w+ \((\w+)\)", b).group(1) for b in calls]  # type: ignore[union-attr]
        assert len(set(ids)) == len(ids)
        for block, call_id in zip(calls, ids, strict=True):
            call_text, result = block.split("\nTool result ", 1)
            result = "Tool result " + result
            assert result.startswith(f"Tool result get_item ({call_id})") or result.startswith(
                f"Tool result propose_changeset ({call_id})"
            ), (block, result)
            name, arguments = re.match(r"Tool call (\w+) \(\w+\): (.*)", call_text, re.S).groups()  # type: ignore[union-attr]
            content = result.split(": ", 1)[1]
            call = gateway_pb2.ToolCall(name=name, arguments=arguments)
            assert matches(call, content)

    # Two writes whose provider ids were the same both happened, once each.
    proposals = rig.stack.calls_for("ProposeChangeset")
    request_ids = [record.request_id for record in proposals]
    assert len(request_ids) == 2 and len(set(request_ids)) == 2
    assert all(rig.stack.writes[request_id] == 1 for request_id in request_ids)

    # The transcript stores the planner's ids (unique) beside the provider's.
    transcript = await rig.transcript(session_id)
    calls = [m for m in transcript if m.kind == KIND.MESSAGE_KIND_TOOL_CALL]
    assert len(calls) == 5 and len({m.tool_call_id for m in calls}) == 5
    results = [m for m in transcript if m.kind == KIND.MESSAGE_KIND_TOOL_RESULT]
    assert sorted(m.tool_call_id for m in results) == sorted(m.tool_call_id for m in calls)


async def test_a_cancelled_turn_whose_provider_reused_an_id_gets_a_result_for_every_call(
    rig: Rig,
) -> None:
    session_id, _ = await rig.run_turn("first")
    rig.stack.faults.set(method="GetItem", delay_s=60)
    after = (await rig.get_session(session_id)).last_sequence
    async with rig.chat() as stream:
        await stream.open(session_id, after_sequence=after)
        await stream.opened()
        await stream.send("slow", "slow-1")
        started = (await stream.until_kind("message_accepted"))[-1]
        # The first turn read PAN-5; this one's read is the second.
        await rig.stack.call_log.wait_for(lambda log: log.started("GetItem") == 2)
        await stream.cancel(started.turn_id)
        received = await stream.turn()
    ended = events(received, "turn_ended")[-1].turn_ended
    assert ended.reason == END.TURN_END_REASON_CANCELLED
    rig.stack.faults.clear()

    transcript = await rig.transcript(session_id)
    turn_calls = [
        m
        for m in transcript
        if m.kind == KIND.MESSAGE_KIND_TOOL_CALL and m.turn_id == started.turn_id
    ]
    assert len(turn_calls) == 1
    results = {
        m.tool_call_id: m for m in transcript if m.kind == KIND.MESSAGE_KIND_TOOL_RESULT
    }
    assert error_reason(results[turn_calls[0].tool_call_id].tool_result) == "CANCELLED"

    # The next turn's request is valid: every call has its result.
    await wait_for(rig.run_turn("first", session_id=session_id))
    assert_paired(rig.requests()[-1])
