"""The provider conformance cases through the real planner: ``start_planner`` on the devstack,
whose gateway's ``openai`` provider is pointed at our OpenAI-compatible double, driven
over ``Chat`` to the stored transcript (as tests/service/turn_support.py does with the
scripted model).

Time: the model deadlines are the defaults divided by ``SCALE`` (and the streams' pace
with them), so "90 s of argument streaming with the default settings" is 0.9 s of
streaming against deadlines of a hundredth of the defaults. Nothing else is scaled.

A cut answer's reason is stored on the assistant message (``finish_reason``; decision
0112).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from ballet.planner.v1 import chat_pb2, planner_service_pb2_grpc, resources_pb2
from ballet.planner.v1 import planner_service_pb2 as pb

from ballet_common.tokens import Trust, dev_secret, mint_dev_token
from devstack.gateway import add_gateway_service
from devstack.gateway.openai_provider import OpenAIProvider
from devstack.server import DevStack, DevStackConfig
from service.config import Settings
from service.server.root import PlannerApp, start_planner
from tests.conformance.cases import PLANTED_KEY, TWO_CALLS, UNAUTHORIZED, ok
from tests.conformance.openai_double import (
    OpenAIDouble,
    Reply,
    call_fragment,
    calls_delta,
    chunk,
    error_body,
    usage_chunk,
)
from tests.service.planner_support import auth, planner_settings
from tests.service.turn_support import ChatStream, events

SCALE = 100.0
DEFAULTS = Settings().dependencies
FIRST_S = DEFAULTS.model_first_delta_s / SCALE
IDLE_S = DEFAULTS.model_idle_s / SCALE
#: The pace of a slow stream: well inside the idle deadline.
PACE_S = 0.05
#: 90 s of output at the defaults' scale.
NINETY_S = 90.0 / SCALE

M = resources_pb2


@dataclass
class Planner:
    double: OpenAIDouble
    stack: DevStack
    app: PlannerApp
    channel: grpc.aio.Channel
    stub: Any
    data_dir: Path

    def meta(self) -> Any:
        return auth(mint_dev_token(self.stack.dev_secret, "alice"))

    async def turn(self, replies: list[Reply], text: str = "What are the open epics?") -> Turn:
        self.double.reset(replies)
        self.stack.call_log.clear()
        created = await self.stub.CreateSession(
            pb.CreateSessionRequest(request_id=f"create-{time.monotonic_ns()}", project_id="demo"),
            metadata=self.meta(),
        )
        session_id = created.session.session_id
        call = self.stub.Chat(metadata=self.meta())
        stream = ChatStream(call)
        try:
            await stream.open(session_id)
            await stream.opened()
            await stream.send(text, f"send-{time.monotonic_ns()}")
            await stream.turn()
        finally:
            stream.close()
        return Turn(self, session_id, stream.received)


@dataclass
class Turn:
    planner: Planner
    session_id: str
    received: list[chat_pb2.ChatResponse]

    @property
    def ended(self) -> chat_pb2.TurnEnded:
        return events(self.received, "turn_ended")[-1].turn_ended

    async def transcript(self) -> list[resources_pb2.Message]:
        page = await self.planner.stub.ListMessages(
            pb.ListMessagesRequest(session_id=self.session_id, page_size=1000),
            metadata=self.planner.meta(),
        )
        return list(page.messages)


@pytest.fixture(scope="module")
async def planner(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Planner]:
    data_dir = tmp_path_factory.mktemp("planner-conformance")
    double = OpenAIDouble()
    await double.start()
    provider = OpenAIProvider(
        base_url=double.base_url, api_key=PLANTED_KEY, model="double-1", timeout_s=30
    )
    # The gateway trusts the credential the planner mints from this data directory.
    trust = Trust.dev(dev_secret(data_dir))
    stack = await DevStack.start(
        DevStackConfig(
            data_dir=data_dir,
            address="127.0.0.1:0",
            extra_services=lambda server: add_gateway_service(server, provider, trust=trust),
        )
    )
    settings = planner_settings(
        data_dir,
        stack.address,
        DEPENDENCIES__MODEL_FIRST_DELTA_S=str(FIRST_S),
        DEPENDENCIES__MODEL_IDLE_S=str(IDLE_S),
        DEPENDENCIES__MODEL_TOTAL_S=str(DEFAULTS.model_total_s / SCALE),
        LOGGING__LEVEL="DEBUG",
    )
    app = await start_planner(settings)
    channel = grpc.aio.insecure_channel(app.address)
    yield Planner(
        double,
        stack,
        app,
        channel,
        planner_service_pb2_grpc.PlannerServiceStub(channel),
        data_dir,
    )
    await channel.close()
    await app.stop(0)
    await stack.stop(0)
    await provider.aclose()
    await double.stop()


def answer(text: str) -> Reply:
    return ok(chunk({"content": text}), chunk({}, "stop"), usage_chunk(), "[DONE]")


def kinds_of(messages: list[resources_pb2.Message]) -> list[int]:
    return [m.kind for m in messages]


# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seconds", [NINETY_S, FIRST_S * 1.5], ids=["ninety-seconds", "beyond-the-first-deadline"]
)
async def test_long_argument_streaming_completes(planner: Planner, seconds: float) -> None:
    """90 s of arguments with the default deadlines; and arguments streaming longer than
    the first-output deadline, which only counting them as output keeps alive."""
    # One character per fragment; JSON whitespace makes the call as long as needed.
    arguments = '{"kind":"epic",' + " " * int(seconds / PACE_S) + '"state":"open"}'
    fragments = [chunk(calls_delta(call_fragment(0, "call_slow", "list_items", "")))]
    fragments += [chunk(calls_delta(call_fragment(0, arguments=char))) for char in arguments]
    slow = ok(*fragments, chunk({}, "tool_calls"), usage_chunk(), "[DONE]", delay_s=PACE_S)
    assert len(fragments) * PACE_S >= seconds
    turn = await planner.turn([slow, answer("There are open epics.")])
    assert turn.ended.reason == M.TURN_END_REASON_COMPLETED, turn.ended.error_message
    messages = await turn.transcript()
    calls = [m for m in messages if m.kind == M.MESSAGE_KIND_TOOL_CALL]
    results = [m for m in messages if m.kind == M.MESSAGE_KIND_TOOL_RESULT]
    assert [(c.tool_name, c.tool_arguments) for c in calls] == [("list_items", arguments)]
    assert len(results) == 1 and not results[0].tool_error
    assert messages[-1].text == "There are open epics."


async def test_ninety_seconds_of_reasoning_completes_and_is_not_stored(planner: Planner) -> None:
    thoughts = [
        chunk({"reasoning_content": f"thought {i}. "}) for i in range(int(NINETY_S / PACE_S))
    ]
    reply = ok(
        *thoughts,
        chunk({"content": "Done."}),
        chunk({}, "stop"),
        usage_chunk(),
        "[DONE]",
        delay_s=PACE_S,
    )
    turn = await planner.turn([reply])
    assert turn.ended.reason == M.TURN_END_REASON_COMPLETED, turn.ended.error_message
    messages = await turn.transcript()
    assert messages[-1].text == "Done."
    assert not any("thought 3." in m.text for m in messages)


async def test_reasoning_longer_than_the_first_output_deadline_keeps_the_call_alive(
    planner: Planner,
) -> None:
    count = int(FIRST_S * 1.5 / PACE_S)
    thoughts = [chunk({"reasoning": "hmm "}) for _ in range(count)]
    reply = ok(*thoughts, chunk({"content": "Done."}), chunk({}, "stop"), "[DONE]", delay_s=PACE_S)
    turn = await planner.turn([reply])
    assert turn.ended.reason == M.TURN_END_REASON_COMPLETED, turn.ended.error_message


async def test_silence_fails_model_timeout_at_the_first_output_deadline(planner: Planner) -> None:
    turn = await planner.turn([Reply(pieces=[], end="hang")])
    assert turn.ended.reason == M.TURN_END_REASON_FAILED
    assert turn.ended.error_info.reason == "MODEL_TIMEOUT"
    assert f"no output in {FIRST_S:g} s" in turn.ended.error_message
    # One attempt: a deadline is not retried.
    assert len(planner.double.received) == 1


# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [0, None], ids=["shared-index-0", "no-index"])
async def test_ollama_parallel_calls_run_separately(planner: Planner, index: int | None) -> None:
    parallel = ok(
        chunk(
            calls_delta(
                call_fragment(index, "call_a1", "list_items", TWO_CALLS[0][1]),
                call_fragment(index, "call_b2", "list_runnable", "{}"),
            )
        ),
        chunk({}, "tool_calls"),
        usage_chunk(),
        "[DONE]",
    )
    turn = await planner.turn([parallel, answer("Two answers.")])
    assert turn.ended.reason == M.TURN_END_REASON_COMPLETED, turn.ended.error_message
    messages = await turn.transcript()
    calls = [m for m in messages if m.kind == M.MESSAGE_KIND_TOOL_CALL]
    results = [m for m in messages if m.kind == M.MESSAGE_KIND_TOOL_RESULT]
    assert sorted((c.tool_name, c.tool_arguments) for c in calls) == sorted(TWO_CALLS)
    assert len(results) == 2 and not any(r.tool_error for r in results)
    assert {r.tool_call_id for r in results} == {c.tool_call_id for c in calls}
    methods = sorted(r.method for r in planner.stack.call_log.records)
    assert methods == ["ListItems", "ListRunnableTickets"]
    # The follow-up request pairs each call with its own result, under the provider's ids.
    follow_up = planner.double.received[1].body["messages"]
    sent_calls = next(m for m in follow_up if m.get("tool_calls"))["tool_calls"]
    tool_ids = [m["tool_call_id"] for m in follow_up if m["role"] == "tool"]
    assert [c["id"] for c in sent_calls] == tool_ids and len(set(tool_ids)) == 2


# ---------------------------------------------------------------------------------------


async def test_a_stream_cut_after_text_fails_truncated_and_keeps_the_text_cut(
    planner: Planner,
) -> None:
    cut = ok(chunk({"role": "assistant", "content": "The open epics are"}))
    turn = await planner.turn([cut])
    assert turn.ended.reason == M.TURN_END_REASON_FAILED
    assert turn.ended.error_info.reason == "MODEL_STREAM_TRUNCATED"
    messages = await turn.transcript()
    assert messages[-1].kind == M.MESSAGE_KIND_ASSISTANT
    assert messages[-1].cut and messages[-1].text == "The open epics are"


@pytest.mark.parametrize("finish", [None, "length"], ids=["no-finish", "length"])
async def test_partial_arguments_are_never_executed(planner: Planner, finish: str | None) -> None:
    events_ = [chunk(calls_delta(call_fragment(0, "call_x", "get_item", '{"item_id": "de')))]
    if finish is not None:
        events_ += [chunk({}, finish), usage_chunk(), "[DONE]"]
    turn = await planner.turn([ok(*events_), answer("unused")])
    assert turn.ended.reason != M.TURN_END_REASON_COMPLETED or finish == "length"
    messages = await turn.transcript()
    calls = [m for m in messages if m.kind == M.MESSAGE_KIND_TOOL_CALL]
    if finish == "length":
        # Decision 0292: the cut call is kept (cut) and answered with an error result.
        (call,) = calls
        assert call.cut
        (result,) = [m for m in messages if m.kind == M.MESSAGE_KIND_TOOL_RESULT]
        assert result.tool_error and "CUT_AT_OUTPUT_LIMIT" in result.tool_result
    else:
        assert calls == []
    assert planner.stack.call_log.for_method("GetItem") == []


async def test_two_answers_cut_inside_a_call_end_the_turn_output_limit(planner: Planner) -> None:
    cut = ok(
        chunk(calls_delta(call_fragment(0, "call_x", "get_item", '{"item_id": "de'))),
        chunk({}, "length"),
        usage_chunk(),
        "[DONE]",
    )
    turn = await planner.turn([cut])
    assert turn.ended.reason == M.TURN_END_REASON_OUTPUT_LIMIT
    assert turn.ended.error_info.reason == "OUTPUT_LIMIT_CUT_CALLS"
    assert len(planner.double.received) == 2
    assert planner.stack.call_log.for_method("GetItem") == []


async def test_complete_repeated_calls_at_length_run_once_and_the_turn_goes_on(
    planner: Planner,
) -> None:
    """An answer of complete repeated calls ending at length runs each distinct call once,
    the cut call gets an error result, and the turn goes on (decision 0292)."""
    epic, runnable = '{"kind":"epic"}', "{}"
    reply = ok(
        chunk(calls_delta(call_fragment(0, "call_0", "list_items", epic))),
        chunk(calls_delta(call_fragment(1, "call_1", "list_runnable", runnable))),
        chunk(calls_delta(call_fragment(2, "call_2", "list_items", epic))),
        chunk(calls_delta(call_fragment(3, "call_3", "list_items", epic))),
        chunk(calls_delta(call_fragment(4, "call_4", "list_items", '{"kind": "ep'))),
        chunk({}, "length"),
        usage_chunk(),
        "[DONE]",
    )
    turn = await planner.turn([reply, answer("Here are the epics.")])
    assert turn.ended.reason == M.TURN_END_REASON_COMPLETED, turn.ended.error_message
    assert len(planner.stack.call_log.for_method("ListItems")) == 1
    assert len(planner.stack.call_log.for_method("ListRunnableTickets")) == 1
    messages = await turn.transcript()
    calls = [m for m in messages if m.kind == M.MESSAGE_KIND_TOOL_CALL]
    results = {m.tool_call_id: m for m in messages if m.kind == M.MESSAGE_KIND_TOOL_RESULT}
    assert len(calls) == 5 and len(results) == 5
    shared = {results[calls[i].tool_call_id].tool_result for i in (0, 2, 3)}
    assert len(shared) == 1 and not results[calls[0].tool_call_id].tool_error
    cut = results[calls[4].tool_call_id]
    assert cut.tool_error and "output limit" in cut.tool_result
    # The follow-up request pairs all five calls with results, the cut one's arguments
    # sent as valid JSON.
    follow_up = planner.double.received[1].body["messages"]
    sent = next(m for m in follow_up if m.get("tool_calls"))["tool_calls"]
    assert all(json.loads(c["function"]["arguments"]) is not None for c in sent)
    assert len([m for m in follow_up if m["role"] == "tool"]) == 5


async def test_every_model_request_carries_the_output_cap_as_max_tokens(planner: Planner) -> None:
    # Decision 0291: the planner's cap reaches the server in the field it reads.
    turn = await planner.turn([answer("Hello there, nice to meet.")], "Say hello in five words.")
    assert turn.ended.reason == M.TURN_END_REASON_COMPLETED
    bodies = [r.body for r in planner.double.received]
    assert bodies and all(body.get("max_tokens") == 2048 for body in bodies)
    # The served model, as the server's chunks name it, is stored with the answer and
    # sent to the client (decision 0297).
    assistant = events(turn.received, "assistant_message")[-1].assistant_message.message
    assert assistant.served_model == "double-1"
    stored = [m for m in await turn.transcript() if m.message_id == assistant.message_id]
    assert stored[0].served_model == "double-1"


@pytest.mark.parametrize("finish", ["length", "content_filter"])
async def test_length_and_content_filter_reach_the_client_as_a_cut_answer(
    planner: Planner, finish: str
) -> None:
    cut = ok(chunk({"content": "Partial answ"}), chunk({}, finish), usage_chunk(), "[DONE]")
    turn = await planner.turn([cut])
    assistant = events(turn.received, "assistant_message")[-1].assistant_message.message
    assert assistant.text == "Partial answ" and assistant.cut
    # Decision 0112: the answer says why it is cut; at its output limit the turn says so
    # too (decision 0291), a filtered one completes.
    assert assistant.finish_reason == finish
    expected = M.TURN_END_REASON_OUTPUT_LIMIT if finish == "length" else M.TURN_END_REASON_COMPLETED
    assert turn.ended.reason == expected
    stored = [m for m in await turn.transcript() if m.message_id == assistant.message_id]
    assert stored == [assistant]


# ---------------------------------------------------------------------------------------


async def test_a_planted_key_reaches_no_client_log_line_or_database(
    planner: Planner, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    turn = await planner.turn([UNAUTHORIZED])
    assert turn.ended.reason == M.TURN_END_REASON_FAILED
    assert turn.ended.error_info.reason == "CREDENTIAL_EXPIRED"
    assert "HTTP 401" in turn.ended.error_message
    seen = [r.SerializeToString() for r in turn.received]
    stored = await planner.stub.GetTurn(
        pb.GetTurnRequest(session_id=turn.session_id, turn_id=turn.received[-1].turn_id),
        metadata=planner.meta(),
    )
    seen.append(stored.SerializeToString())
    seen += [m.SerializeToString() for m in await turn.transcript()]
    for path in planner.data_dir.rglob("*.db*"):
        seen.append(path.read_bytes())
    for secret in (PLANTED_KEY, "Zq8dX3vL0pR7"):
        assert not any(secret.encode() in blob for blob in seen)
        assert secret not in caplog.text


# --------------------------------------------------------------------------- malformed calls


async def test_a_nameless_call_among_fourteen_keeps_the_answer_and_gets_an_error_result(
    planner: Planner,
) -> None:
    """What an OpenAI-compatible server sent in the trial: fourteen calls and one without
    a name. The fourteen are answered (the first runs, its exact repeats share its result,
    decision 0292), the nameless one gets an error result the model reads, and the turn
    completes; before, the gateway refused the whole answer, three times (decision 0223)."""
    fragments = [call_fragment(i, f"call_{i}", "list_items", '{"kind":"epic"}') for i in range(14)]
    fragments.append(call_fragment(14, "call_14", None, '{"kind":"epic"}'))
    reply = ok(chunk(calls_delta(*fragments)), chunk({}, "tool_calls"), usage_chunk(), "[DONE]")
    turn = await planner.turn([reply, answer("Here they are.")])
    assert turn.ended.reason == M.TURN_END_REASON_COMPLETED, turn.ended.error_message
    assert len(planner.double.received) == 2  # one answer, one follow-up: no retries
    messages = await turn.transcript()
    calls = [m for m in messages if m.kind == M.MESSAGE_KIND_TOOL_CALL]
    results = {m.tool_call_id: m for m in messages if m.kind == M.MESSAGE_KIND_TOOL_RESULT}
    assert [c.tool_name for c in calls] == ["list_items"] * 14 + [""]
    assert all(not results[c.tool_call_id].tool_error for c in calls[:14])
    assert len({results[c.tool_call_id].tool_result for c in calls[:14]}) == 1
    nameless = results[calls[14].tool_call_id]
    assert nameless.tool_error and '"UNKNOWN_TOOL"' in nameless.tool_result
    assert len(planner.stack.call_log.for_method("ListItems")) == 1
    # The follow-up answers all fifteen calls, each under its own id.
    follow_up = planner.double.received[1].body["messages"]
    sent_calls = next(m for m in follow_up if m.get("tool_calls"))["tool_calls"]
    tool_ids = [m["tool_call_id"] for m in follow_up if m["role"] == "tool"]
    assert sorted(c["id"] for c in sent_calls) == sorted(tool_ids) and len(set(tool_ids)) == 15
    # Under a name the API takes: an empty one would have the next request refused.
    assert sent_calls[14]["function"]["name"] == "invalid_tool_name"


async def test_a_400_refusing_the_tools_ends_the_turn_with_its_own_reason(
    planner: Planner,
) -> None:
    refusal = Reply(
        status=400,
        headers={"content-type": "application/json"},
        pieces=error_body("registry.ollama.ai/library/gemma:2b does not support tools", "x", None),
    )
    turn = await planner.turn([refusal])
    assert turn.ended.reason == M.TURN_END_REASON_FAILED
    assert turn.ended.error_info.reason == "TOOLS_NOT_SUPPORTED"
    assert "does not support tools" in turn.ended.error_message
    assert len(planner.double.received) == 1  # not retried


async def test_tools_a_server_dropped_are_counted_and_the_turn_completes(
    planner: Planner, caplog: pytest.LogCaptureFixture
) -> None:
    """What llama.cpp reported with SmolLM2's own template: 643 prompt tokens for a
    request whose twelve tool declarations alone take far more (decision 0297)."""
    registry = planner.app.metrics.registry

    def seen() -> float:
        return registry.get_sample_value("ballet_planner_tools_not_seen_total") or 0.0

    before = seen()
    dropped = ok(chunk({"content": "Hello!"}), chunk({}, "stop"), usage_chunk(643, 3), "[DONE]")
    with caplog.at_level(logging.WARNING):
        turn = await planner.turn([dropped], "Say hello.")
        await planner.turn([dropped], "Say hello again.")
    assert turn.ended.reason == M.TURN_END_REASON_COMPLETED
    assert seen() == before + 2
    warned = [r for r in caplog.records if "dropped the tools" in r.getMessage()]
    assert len(warned) <= 1 and (before > 0 or len(warned) == 1)
