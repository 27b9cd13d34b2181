"""The scripted provider (devstack/gateway/scripted.py), through a real grpc.aio server and
client."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from ballet.llm.v1 import gateway_pb2

from devstack.gateway import ScenarioError, ScriptedProvider
from devstack.gateway.scripted import TOOL_RESULT_MAX_CHARS, Scenario, demo_provider
from tests.devstack.gateway_support import (
    GatewayHarness,
    StartGateway,
    assistant,
    human,
    request,
    tool,
)

CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


async def scripted(start_gateway: StartGateway, rules: Any) -> GatewayHarness:
    return await start_gateway(ScriptedProvider(rules))


# --- match keys ---------------------------------------------------------------------------


async def test_purpose_selects_turn_or_compaction(start_gateway: StartGateway) -> None:
    gw = await scripted(
        start_gateway,
        {
            "rules": [
                {"match": {"purpose": "compaction"}, "reply": {"text": "summary"}},
                {"match": {"purpose": "turn"}, "reply": {"text": "answer"}},
            ]
        },
    )
    assert (await gw.generate(request(human("hi"), purpose="compaction"))).text == "summary"
    assert (await gw.generate(request(human("hi"), purpose="turn"))).text == "answer"


async def test_last_role_human_or_tool(start_gateway: StartGateway) -> None:
    gw = await scripted(
        start_gateway,
        [
            {"match": {"last_role": "tool"}, "reply": {"text": "after tool"}},
            {"match": {"last_role": "human"}, "reply": {"text": "after human"}},
        ],
    )
    assert (await gw.generate(request(human("hi")))).text == "after human"
    convo = [human("hi"), assistant(calls=[("c1", "list_runnable", "{}")]), tool("c1", "x", "[]")]
    assert (await gw.generate(request(*convo))).text == "after tool"


async def test_last_text_regex_reads_human_text_and_tool_content(
    start_gateway: StartGateway,
) -> None:
    gw = await scripted(
        start_gateway,
        [
            {"match": {"last_text_regex": "(?i)epics"}, "reply": {"text": "epics"}},
            {"match": {"last_text_regex": r'"state":\s*"open"'}, "reply": {"text": "open"}},
            {"reply": {"text": "other"}},
        ],
    )
    assert (await gw.generate(request(human("Show open EPICS please")))).text == "epics"
    convo = [human("x"), assistant(calls=[("c1", "get_item", "{}")])]
    with_result = request(*convo, tool("c1", "get_item", '{"id": "demo-1", "state": "open"}'))
    assert (await gw.generate(with_result)).text == "open"
    assert (await gw.generate(request(human("hello")))).text == "other"


async def test_compaction_regex_reads_the_last_human_message(start_gateway: StartGateway) -> None:
    gw = await scripted(
        start_gateway,
        [
            {
                "match": {"purpose": "compaction", "last_text_regex": "^Summarize"},
                "reply": {"text": "summary"},
            },
            {"match": {"purpose": "compaction"}, "reply": {"text": "wrong text"}},
        ],
    )
    req = request(
        human("old question"),
        human("Summarize the conversation above."),
        assistant("an earlier answer"),
        purpose="compaction",
    )
    assert (await gw.generate(req)).text == "summary"


async def test_tool_name_uses_the_result_name_or_the_call_name(start_gateway: StartGateway) -> None:
    gw = await scripted(
        start_gateway,
        [
            {"match": {"tool_name": "get_item"}, "reply": {"text": "item"}},
            {"match": {"tool_name": "list_items"}, "reply": {"text": "items"}},
            {"reply": {"text": "none"}},
        ],
    )
    call = assistant(calls=[("c1", "get_item", '{"item_id":"demo-1"}')])
    assert (await gw.generate(request(human("q"), call, tool("c1", "get_item", "{}")))).text == (
        "item"
    )
    # No name on the result: the name of the call it answers counts.
    other = assistant(calls=[("c2", "list_items", "{}")])
    assert (await gw.generate(request(human("q"), other, tool("c2", "", "[]")))).text == "items"
    assert (await gw.generate(request(human("q")))).text == "none"


async def test_tool_results_in_turn_counts_since_the_latest_human(
    start_gateway: StartGateway,
) -> None:
    gw = await scripted(
        start_gateway,
        [
            {"match": {"tool_results_in_turn": 0}, "reply": {"text": "zero"}},
            {"match": {"tool_results_in_turn": 1}, "reply": {"text": "one"}},
            {"match": {"tool_results_in_turn": 2}, "reply": {"text": "two"}},
        ],
    )
    earlier_turn = [
        human("first"),
        assistant(calls=[("a", "list_runnable", "{}")]),
        tool("a", "list_runnable", "[]"),
        assistant("done"),
    ]
    assert (await gw.generate(request(*earlier_turn, human("second")))).text == "zero"
    round_1 = [assistant(calls=[("b", "get_item", "{}"), ("c", "get_item", "{}")])]
    one = request(*earlier_turn, human("second"), *round_1, tool("b", "get_item", "{}"))
    assert (await gw.generate(one)).text == "one"
    two = request(*one.messages, tool("c", "get_item", "{}"))
    assert (await gw.generate(two)).text == "two"


async def test_the_first_matching_rule_wins(start_gateway: StartGateway) -> None:
    gw = await scripted(
        start_gateway,
        [
            {"match": {"last_role": "human", "last_text_regex": "x"}, "reply": {"text": "a"}},
            {"match": {"last_role": "human"}, "reply": {"text": "b"}},
            {"match": {"last_role": "human"}, "reply": {"text": "c"}},
        ],
    )
    assert (await gw.generate(request(human("x")))).text == "a"
    assert (await gw.generate(request(human("y")))).text == "b"


async def test_no_matching_rule_is_failed_precondition_naming_the_request(
    start_gateway: StartGateway,
) -> None:
    gw = await scripted(start_gateway, [{"match": {"purpose": "compaction"}, "reply": {}}])
    failure = await gw.fail(request(human("What can I work on today?")))
    assert failure.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "purpose=turn" in failure.message
    assert "last_role=human" in failure.message
    assert "What can I work on" in failure.message
    assert failure.error_info.reason == "NO_MATCHING_RULE"
    assert failure.error_info.domain == "llm.ballet"


# --- reply keys ---------------------------------------------------------------------------


async def test_text_is_one_delta_then_stop(start_gateway: StartGateway) -> None:
    gw = await scripted(start_gateway, [{"reply": {"text": "Hello there, human."}}])
    answer = await gw.generate(request(human("hi")))
    assert answer.kinds == ["text_delta", "finish"]
    assert answer.deltas == ["Hello there, human."]
    assert answer.finish.reason == gateway_pb2.FINISH_REASON_STOP
    assert not answer.finish.HasField("usage")


async def test_chunk_chars_splits_the_text(start_gateway: StartGateway) -> None:
    gw = await scripted(start_gateway, [{"reply": {"text": "abcdefghij", "chunk_chars": 4}}])
    assert (await gw.generate(request(human("hi")))).deltas == ["abcd", "efgh", "ij"]


async def test_empty_reply_finishes_with_stop_and_nothing_else(start_gateway: StartGateway) -> None:
    gw = await scripted(start_gateway, [{"reply": {}}])
    answer = await gw.generate(request(human("hi")))
    assert answer.kinds == ["finish"]
    assert answer.finish.reason == gateway_pb2.FINISH_REASON_STOP


async def test_tool_calls_get_fresh_ids_compact_json_and_finish_tool_calls(
    start_gateway: StartGateway,
) -> None:
    gw = await scripted(
        start_gateway,
        [
            {
                "reply": {
                    "text": "Let me look.",
                    "tool_calls": [
                        {"name": "list_items", "arguments": {"kind": "epic", "state": "open"}},
                        {"name": "list_runnable", "arguments": {}},
                        {"name": "list_runnable"},
                    ],
                }
            }
        ],
    )
    first = await gw.generate(request(human("hi")))
    streamed = ["tool_call_start", "tool_call_delta"] * 3
    assert first.kinds == ["text_delta", *streamed, "tool_call", "tool_call", "tool_call", "finish"]
    assert [(c.name, c.arguments) for c in first.tool_calls] == [
        ("list_items", '{"kind":"epic","state":"open"}'),
        ("list_runnable", "{}"),
        ("list_runnable", "{}"),
    ]
    assert first.finish.reason == gateway_pb2.FINISH_REASON_TOOL_CALLS
    second = await gw.generate(request(human("hi")))
    ids = [c.id for c in first.tool_calls + second.tool_calls]
    assert all(CALL_ID.match(i) for i in ids), ids
    assert len(set(ids)) == len(ids)


async def test_raw_arguments_are_sent_verbatim_even_when_invalid(
    start_gateway: StartGateway,
) -> None:
    raw = '{"item_id": "demo-1",'
    gw = await scripted(
        start_gateway, [{"reply": {"tool_calls": [{"name": "get_item", "raw_arguments": raw}]}}]
    )
    answer = await gw.generate(request(human("hi")))
    assert [c.arguments for c in answer.tool_calls] == [raw]
    with pytest.raises(json.JSONDecodeError):
        json.loads(answer.tool_calls[0].arguments)


async def test_usage_is_reported_in_the_finish(start_gateway: StartGateway) -> None:
    gw = await scripted(
        start_gateway,
        [{"reply": {"text": "ok", "usage": {"input_tokens": 1234, "output_tokens": 56}}}],
    )
    finish = (await gw.generate(request(human("hi")))).finish
    assert finish.HasField("usage")
    assert (finish.usage.input_tokens, finish.usage.output_tokens) == (1234, 56)


async def test_delay_ms_is_slept_before_each_delta_or_before_the_finish() -> None:
    slept: list[tuple[float, int]] = []
    seen = 0

    async def record(seconds: float) -> None:
        slept.append((seconds, seen))

    provider = ScriptedProvider(
        [
            {
                "match": {"last_text_regex": "text"},
                "reply": {"text": "abc", "chunk_chars": 1, "delay_ms": 25},
            },
            {
                "match": {"last_text_regex": "calls"},
                "reply": {"tool_calls": [{"name": "list_runnable"}], "delay_ms": 40},
            },
        ],
        sleep=record,
    )
    async for _ in provider.generate(request(human("text"))):
        seen += 1
    # One sleep before each of the three deltas, none before the finish.
    assert slept == [(0.025, 0), (0.025, 1), (0.025, 2)]
    slept.clear()
    seen = 0
    async for _ in provider.generate(request(human("calls"))):
        seen += 1
    assert slept == [(0.04, 0)]


async def test_delay_ms_delays_the_stream_on_the_wire(start_gateway: StartGateway) -> None:
    gw = await scripted(
        start_gateway, [{"reply": {"text": "abcd", "chunk_chars": 2, "delay_ms": 30}}]
    )
    started = time.monotonic()
    answer = await gw.generate(request(human("hi")))
    assert answer.deltas == ["ab", "cd"]
    assert time.monotonic() - started >= 0.06


async def test_error_fails_with_the_code_and_an_error_info(start_gateway: StartGateway) -> None:
    gw = await scripted(
        start_gateway,
        [{"reply": {"text": "never sent", "error": {"code": "UNAVAILABLE", "message": "down"}}}],
    )
    failure = await gw.fail(request(human("hi")))
    assert failure.code == grpc.StatusCode.UNAVAILABLE
    assert failure.message == "down"
    assert failure.responses == []
    assert failure.error_info.reason == "UNAVAILABLE"
    assert failure.retry_info is None


async def test_error_reason_and_retry_after(start_gateway: StartGateway) -> None:
    error = {
        "code": "RESOURCE_EXHAUSTED",
        "message": "slow down",
        "reason": "RATE_LIMITED",
        "retry_after_ms": 1500,
    }
    gw = await scripted(start_gateway, [{"reply": {"error": error}}])
    failure = await gw.fail(request(human("hi")))
    assert failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert failure.error_info.reason == "RATE_LIMITED"
    retry = failure.retry_info
    assert retry is not None
    assert (retry.retry_delay.seconds, retry.retry_delay.nanos) == (1, 500_000_000)


async def test_error_after_deltas_sends_deltas_then_fails(start_gateway: StartGateway) -> None:
    gw = await scripted(
        start_gateway,
        [
            {
                "reply": {
                    "text": "one two three four",
                    "chunk_chars": 4,
                    "error": {"code": "UNAVAILABLE", "message": "cut"},
                    "error_after_deltas": 2,
                }
            }
        ],
    )
    failure = await gw.fail(request(human("hi")))
    assert failure.code == grpc.StatusCode.UNAVAILABLE
    assert [r.text_delta.text for r in failure.responses] == ["one ", "two "]


async def test_tool_result_placeholder_shows_the_last_result_cut(
    start_gateway: StartGateway,
) -> None:
    gw = await scripted(
        start_gateway,
        [
            {
                "match": {"last_role": "tool"},
                "reply": {"text": "Found: {{tool_result}} (end)", "chunk_chars": 50},
            },
            {"reply": {"text": "[{{ tool_result }}]"}},
        ],
    )
    call = assistant(calls=[("c1", "list_items", "{}")])
    short = '[{"id":"demo-1","title":"Epic \\"one\\""}]'
    answer = await gw.generate(request(human("q"), call, tool("c1", "list_items", short)))
    assert answer.text == f"Found: {short} (end)"
    long = json.dumps([{"id": f"demo-{i}", "title": "x" * 20} for i in range(100)])
    answer = await gw.generate(request(human("q"), call, tool("c1", "list_items", long)))
    shown = answer.text.removeprefix("Found: ").removesuffix(" (end)")
    assert len(shown) == TOOL_RESULT_MAX_CHARS
    assert shown == long[: TOOL_RESULT_MAX_CHARS - 1] + "…"
    assert (await gw.generate(request(human("no tool yet")))).text == "[]"


async def test_match_groups_fill_tool_arguments(start_gateway: StartGateway) -> None:
    gw = await scripted(
        start_gateway,
        [
            {
                "match": {"last_text_regex": r"(?i)\bitem\s+(?P<id>[\w.-]+)"},
                "reply": {
                    "text": "Looking up {{match:id}}.",
                    "tool_calls": [
                        {"name": "get_item", "arguments": {"item_id": "{{match:1}}"}},
                        {
                            "name": "search_knowledge",
                            "arguments": {"query": "{{match:0}}", "kinds": ["{{match:id}}"]},
                        },
                        {"name": "get_item", "raw_arguments": '{"item_id":"{{match:id}}"}'},
                    ],
                },
            },
            {
                "match": {"last_text_regex": r'say "(.*)"|(never)'},
                "reply": {
                    "tool_calls": [
                        {"name": "echo", "arguments": {"a": "{{match:1}}", "b": "{{match:2}}"}}
                    ]
                },
            },
        ],
    )
    answer = await gw.generate(request(human("Show me item bd-a1b2.3 please")))
    assert answer.text == "Looking up bd-a1b2.3."
    assert [json.loads(c.arguments) for c in answer.tool_calls] == [
        {"item_id": "bd-a1b2.3"},
        {"query": "item bd-a1b2.3", "kinds": ["bd-a1b2.3"]},
        {"item_id": "bd-a1b2.3"},
    ]
    # Captured text is JSON-escaped inside `arguments`; a group that did not take part is "".
    quoted = await gw.generate(request(human('say "a \\ "quoted" word"')))
    assert json.loads(quoted.tool_calls[0].arguments) == {"a": 'a \\ "quoted" word', "b": ""}


# --- scenario loading and validation ------------------------------------------------------


def test_a_bare_list_and_a_rules_object_are_the_same_scenario() -> None:
    rules = [{"match": {"last_role": "human"}, "reply": {"text": "x"}, "comment": "why"}]
    assert Scenario.parse(rules).rules == Scenario.parse({"rules": rules, "comment": "c"}).rules


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ([{"reply": {}}, {"reply": {}, "mach": {}}], r"rule 1: unknown key 'mach'"),
        ([{"match": {"last_txt": "x"}, "reply": {}}], r"rule 0: match: unknown key 'last_txt'"),
        ([{"reply": {"txt": "x"}}], r"rule 0: reply: unknown key 'txt'"),
        ([{"reply": {"usage": {"input": 1}}}], r"rule 0: reply.usage: unknown key 'input'"),
        (
            [{"reply": {"error": {"code": "UNAVAILABLE", "message": "m", "retry": 1}}}],
            r"rule 0: reply.error: unknown key 'retry'",
        ),
        (
            [{"reply": {"tool_calls": [{"name": "t", "args": {}}]}}],
            r"rule 0: reply.tool_calls\[0\]: unknown key 'args'",
        ),
        ({"rule": []}, r"the scenario: unknown key 'rule'"),
        ({"comment": "x"}, r"missing key 'rules'"),
        ("rules", r"expected a list of rules"),
        ([{"match": {}}], r"rule 0: missing key 'reply'"),
        (["x"], r"rule 0: expected an object"),
        ([{"match": {"purpose": "chat"}, "reply": {}}], r"rule 0: match.purpose"),
        ([{"match": {"last_role": "user"}, "reply": {}}], r"rule 0: match.last_role"),
        ([{"match": {"last_text_regex": "("}, "reply": {}}], r"match.last_text_regex: invalid"),
        ([{"match": {"tool_results_in_turn": True}, "reply": {}}], r"tool_results_in_turn"),
        ([{"match": {"tool_results_in_turn": -1}, "reply": {}}], r"tool_results_in_turn"),
        ([{"reply": {"text": 3}}], r"reply.text: expected a string"),
        ([{"reply": {"chunk_chars": 0}}], r"reply.chunk_chars: expected an integer >= 1"),
        ([{"reply": {"delay_ms": -5}}], r"reply.delay_ms"),
        ([{"reply": {"error": {"code": "NOPE", "message": "m"}}}], r"reply.error.code"),
        ([{"reply": {"error": {"code": "OK", "message": "m"}}}], r"other than OK"),
        ([{"reply": {"error": {"code": "UNAVAILABLE"}}}], r"reply.error: missing key 'message'"),
        ([{"reply": {"error_after_deltas": 1}}], r"error_after_deltas: needs 'error'"),
        ([{"reply": {"tool_calls": {"name": "t"}}}], r"reply.tool_calls: expected a list"),
        ([{"reply": {"tool_calls": [{"arguments": {}}]}}], r"missing key 'name'"),
        (
            [{"reply": {"tool_calls": [{"name": "t", "arguments": {}, "raw_arguments": "{}"}]}}],
            r"not both",
        ),
        (
            [{"reply": {"tool_calls": [{"name": "t", "arguments": [1]}]}}],
            r"arguments: expected a JSON object",
        ),
        ([{"reply": {"text": "{{tool_results}}"}}], r"unknown placeholder '\{\{tool_results\}\}'"),
        ([{"reply": {"text": "{{match:1}}"}}], r"needs 'last_text_regex'"),
        (
            [{"match": {"last_text_regex": "(a)"}, "reply": {"text": "{{match:2}}"}}],
            r"has only 1 group",
        ),
        (
            [
                {
                    "match": {"last_text_regex": "(a)"},
                    "reply": {"tool_calls": [{"name": "t", "arguments": {"x": ["{{match:id}}"]}}]},
                }
            ],
            r"reply.tool_calls\[0\].arguments: .*no group named 'id'",
        ),
    ],
)
def test_invalid_scenarios_are_refused_naming_rule_and_key(data: Any, expected: str) -> None:
    with pytest.raises(ScenarioError, match=expected):
        ScriptedProvider(data)


def test_a_scenario_file_must_be_json(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ScenarioError, match=r"broken.json: not valid JSON"):
        ScriptedProvider.from_file(path)
    with pytest.raises(ScenarioError, match=r"cannot read"):
        ScriptedProvider.from_file(tmp_path / "missing.json")


async def test_a_scenario_file_is_reread_when_it_changes(
    start_gateway: StartGateway, tmp_path: Path
) -> None:
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps([{"reply": {"text": "first"}}]))
    gw = await start_gateway(ScriptedProvider.from_file(path))
    assert (await gw.generate(request(human("hi")))).text == "first"

    # Same size and, on a coarse clock, possibly the same mtime: still seen.
    path.write_text(json.dumps([{"reply": {"text": "other"}}]))
    assert (await gw.generate(request(human("hi")))).text == "other"

    path.write_text(json.dumps([{"reply": {"text": "x"}, "oops": 1}]))
    failure = await gw.fail(request(human("hi")))
    assert failure.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "unknown key 'oops'" in failure.message
    assert failure.error_info.reason == "SCENARIO_INVALID"

    # An old file (outside the racy window) is re-read when its stat data changes.
    path.write_text(json.dumps({"rules": [{"reply": {"text": "fixed, and longer"}}]}))
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    assert (await gw.generate(request(human("hi")))).text == "fixed, and longer"


# --- the built-in demo scenario -----------------------------------------------------------


async def demo_gateway(start_gateway: StartGateway) -> GatewayHarness:
    return await start_gateway(demo_provider())


@pytest.mark.parametrize(
    ("question", "tool_name", "arguments"),
    [
        ("What are the open epics?", "list_items", {"kind": "epic", "state": "open"}),
        ("list epics", "list_items", {"kind": "epic", "state": "open"}),
        ("Tell me about demo-12", "get_item", {"item_id": "demo-12"}),
        ("what is bd-a1b2.3 about?", "get_item", {"item_id": "bd-a1b2.3"}),
        ("show item proj-x7", "get_item", {"item_id": "proj-x7"}),
        ("What can I work on?", "list_runnable", {}),
        ("Which tickets are runnable?", "list_runnable", {}),
        (
            "Any decisions about hosting?",
            "search_knowledge",
            {"kind": "decision", "query": "hosting"},
        ),
        ("List the ADRs", "search_knowledge", {"kind": "decision", "query": "List the ADRs"}),
    ],
)
async def test_demo_scenario_calls_the_matching_tool(
    start_gateway: StartGateway, question: str, tool_name: str, arguments: dict[str, Any]
) -> None:
    gw = await demo_gateway(start_gateway)
    answer = await gw.generate(request(human(question)))
    assert [(c.name, json.loads(c.arguments)) for c in answer.tool_calls] == [
        (tool_name, arguments)
    ]
    assert answer.finish.reason == gateway_pb2.FINISH_REASON_TOOL_CALLS


async def test_demo_scenario_answers_with_the_tool_result(start_gateway: StartGateway) -> None:
    gw = await demo_gateway(start_gateway)
    result = '{"items":[{"id":"demo-3","kind":"epic","title":"Ship the planner"}]}'
    call = assistant(calls=[("c1", "list_items", '{"kind":"epic","state":"open"}')])
    req = request(human("open epics?"), call, tool("c1", "list_items", result))
    answer = await gw.generate(req)
    # The result as a line a human reads, not raw tool JSON (decision 0324).
    assert "- demo-3: Ship the planner (kind epic)" in answer.text
    assert result not in answer.text
    assert answer.tool_calls == []
    assert answer.finish.reason == gateway_pb2.FINISH_REASON_STOP


async def test_demo_scenario_explains_itself_and_summarizes(start_gateway: StartGateway) -> None:
    gw = await demo_gateway(start_gateway)
    answer = await gw.generate(request(human("Write me a poem")))
    assert "demo model" in answer.text
    assert "--provider openai" in answer.text
    # Then it looks up the project's own items to suggest (decision 0164).
    assert [call.name for call in answer.tool_calls] == ["list_runnable", "list_items"]
    summary = await gw.generate(request(human("q"), assistant("a"), purpose="compaction"))
    assert summary.text
    assert summary.finish.reason == gateway_pb2.FINISH_REASON_STOP


# --- stream-shaping reply keys --------------------------------------------------


async def test_reasoning_then_streamed_arguments_on_the_wire(start_gateway: StartGateway) -> None:
    gw = await scripted(
        start_gateway,
        [
            {
                "reply": {
                    "reasoning": "thinking hard",
                    "chunk_chars": 5,
                    "tool_calls": [{"name": "list_items", "arguments": {"kind": "epic"}}],
                    "argument_chunk_chars": 4,
                }
            }
        ],
    )
    answer = await gw.generate(request(human("hi")))
    reasoning = [r.reasoning for r in answer.responses if r.WhichOneof("chunk") == "reasoning"]
    # Sizes only: the request did not ask for the reasoning text.
    assert [r.characters for r in reasoning] == [5, 5, 3] and not any(r.text for r in reasoning)
    deltas = [
        r.tool_call_delta.arguments
        for r in answer.responses
        if r.WhichOneof("chunk") == "tool_call_delta"
    ]
    assert "".join(deltas) == '{"kind":"epic"}' and len(deltas) == 4
    assert [(c.name, c.arguments) for c in answer.tool_calls] == [("list_items", '{"kind":"epic"}')]
    assert answer.kinds[:4] == ["reasoning"] * 3 + ["tool_call_start"]
    with_text = request(human("hi"))
    with_text.include_reasoning_text = True
    answer = await gw.generate(with_text)
    texts = [r.reasoning.text for r in answer.responses if r.WhichOneof("chunk") == "reasoning"]
    assert "".join(texts) == "thinking hard"


@pytest.mark.parametrize(
    ("reply", "reason", "calls"),
    [
        ({"refusal": "I can't help with that."}, gateway_pb2.FINISH_REASON_REFUSAL, 0),
        (
            # At the output limit the calls are sent (decision 0292); this one is whole.
            {"text": "cut", "tool_calls": [{"name": "t"}], "finish_reason": "length"},
            gateway_pb2.FINISH_REASON_LENGTH,
            1,
        ),
        (
            {"text": "hidden", "finish_reason": "content_filter"},
            gateway_pb2.FINISH_REASON_CONTENT_FILTER,
            0,
        ),
        (
            {"tool_calls": [{"name": "t"}], "finish_reason": "stop"},
            gateway_pb2.FINISH_REASON_STOP,
            1,
        ),
    ],
    ids=["refusal", "length-inside-calls", "content-filter", "stop-with-calls"],
)
async def test_finish_reason_and_refusal(
    start_gateway: StartGateway, reply: dict[str, Any], reason: int, calls: int
) -> None:
    gw = await scripted(start_gateway, [{"reply": reply}])
    answer = await gw.generate(request(human("hi")))
    assert answer.finish.reason == reason
    # A filtered or refused answer's calls are never sent (proto GenerateResponse).
    assert len(answer.tool_calls) == calls
    assert not any(call.cut for call in answer.tool_calls)
    if "refusal" in reply:
        assert answer.text == reply["refusal"]


@pytest.mark.parametrize("after", [0, 1, 2, 3, 4])
async def test_truncate_after_deltas_ends_truncated_without_calls(
    start_gateway: StartGateway, after: int
) -> None:
    gw = await scripted(
        start_gateway,
        [
            {
                "reply": {
                    "text": "ab",
                    "chunk_chars": 1,
                    "tool_calls": [{"name": "get_item", "arguments": {"item_id": "x"}}],
                    "argument_chunk_chars": 8,
                    "truncate_after_deltas": after,
                    "usage": {"input_tokens": 3, "output_tokens": 1},
                }
            }
        ],
    )
    answer = await gw.generate(request(human("hi")))
    assert answer.finish.reason == gateway_pb2.FINISH_REASON_TRUNCATED
    assert answer.tool_calls == []
    assert len(answer.responses) == after + 1


def test_stream_keys_are_validated() -> None:
    for reply, where in [
        ({"finish_reason": "eos"}, "finish_reason"),
        ({"argument_chunk_chars": 0}, "argument_chunk_chars"),
        ({"truncate_after_deltas": -1}, "truncate_after_deltas"),
        (
            {"error": {"code": "UNAVAILABLE", "message": "x"}, "truncate_after_deltas": 1},
            "not both",
        ),
        ({"reasoning": 3}, "reasoning"),
    ]:
        with pytest.raises(ScenarioError, match=where):
            Scenario.parse([{"reply": reply}])


def test_tool_result_lines_read_as_lines_not_json() -> None:
    from devstack.gateway.scripted import readable_result

    result = json.dumps(
        {
            "items": [
                {"item_id": "PAN-4", "kind": "epic", "title": "Pantry inventory", "priority": 1},
                {"item_id": "PAN-5", "kind": "epic", "title": "Shopping list", "priority": 2},
            ],
            "total_size": 2,
        }
    )
    assert readable_result(result) == (
        "- PAN-4: Pantry inventory (kind epic, priority 1)\n"
        "- PAN-5: Shopping list (kind epic, priority 2)\n"
        "total size: 2"
    )
    many = json.dumps({"items": [{"item_id": f"X-{n}"} for n in range(30)]})
    lines = readable_result(many).splitlines()
    assert len(lines) == 12 and lines[-1] == "(and 19 more)"
    assert readable_result("not json") == "not json"
    proposed = json.dumps(
        {
            "changeset": {
                "changeset_id": "cs-1",
                "status": "proposed",
                "title": "New ticket: add retries",
                "operations": [{"create_item": {"kind": "ticket", "title": "add retries"}}],
            }
        }
    )
    assert readable_result(proposed) == (
        "changeset: cs-1: New ticket: add retries (status proposed)\n"
        "  - create item: add retries (kind ticket)"
    )


def test_an_item_too_long_for_one_line_is_shown_a_field_a_line_cut_at_a_word() -> None:
    from devstack.gateway.scripted import RESULT_LINE_CHARS, readable_result

    words = "the refresh token is never used while the app stays open " * 6
    item = {
        "item_id": "PAN-9",
        "kind": "ticket",
        "title": "Session lifetime bug",
        "description": f"Sessions expire.\n{words}",
        "acceptance_criteria": "A session stays alive in the foreground.",
        "blocked_by_ids": [],
        "blocks_ids": ["PAN-10", "PAN-11"],
    }
    lines = readable_result(json.dumps({"item": item})).splitlines()
    assert lines[0] == "item: PAN-9: Session lifetime bug"
    assert lines[1] == "  kind: ticket"
    described = lines[2]
    assert described.startswith("  description: Sessions expire. the refresh token")
    assert described.endswith("…") and len(described) <= RESULT_LINE_CHARS
    # Cut after a whole word of the text, not inside one.
    assert described.removesuffix("…").split()[-1] in words.split()
    assert lines[3:] == [
        "  acceptance criteria: A session stays alive in the foreground.",
        "  blocks ids: PAN-10, PAN-11",
    ]


def test_the_demo_scenario_shows_no_raw_tool_json() -> None:
    scenario = (Path(__file__).resolve().parents[2] / "devstack/demo/scenario.json").read_text()
    assert "{{tool_result}}" not in scenario and "raw tool result" not in scenario
