"""The gateway client against a hostile gateway on a real loopback server: calls sent
malformed (decision 0223) and requests or answers over a receive limit (decision 0224).

``HostileGateway`` is a ``ballet.llm.v1.GatewayService`` that answers each call with the
responses a test lists, however they break the contract, and serves with the receive
limit a test gives it, as a gateway whose limit is lower than the planner was told.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from ballet.llm.v1 import gateway_pb2, gateway_pb2_grpc
from ballet.planner.v1 import resources_pb2

from service.adapters.gateway import GrpcModelGateway
from service.core.errors import ModelFailure
from service.core.ports import (
    FinishChunk,
    ModelDeadlines,
    ModelMessage,
    ModelRequest,
    Purpose,
    Role,
    ToolCallChunk,
    ToolCallStartChunk,
)
from tests.service.turn_support import Rig, error_reason, events, start_rig, stop_rig

KiB = 1024
R = gateway_pb2.GenerateResponse


def start(index: int, name: str, call_id: str = "") -> R:
    return R(tool_call_start=gateway_pb2.ToolCallStart(index=index, id=call_id, name=name))


def call(name: str, arguments: str = "{}", call_id: str = "") -> R:
    return R(tool_call=gateway_pb2.ToolCall(id=call_id, name=name, arguments=arguments))


def finish(reason: gateway_pb2.FinishReason.ValueType = gateway_pb2.FINISH_REASON_TOOL_CALLS) -> R:
    return R(finish=gateway_pb2.Finish(reason=reason))


def text(value: str) -> R:
    return R(text_delta=gateway_pb2.TextDelta(text=value))


@dataclass
class HostileGateway(gateway_pb2_grpc.GatewayServiceServicer):
    """Answers the n-th call with ``answers[n]`` (the last one again after the end)."""

    answers: list[list[R]] = field(default_factory=list)
    requests: list[gateway_pb2.GenerateRequest] = field(default_factory=list)
    server: Any = None
    address: str = ""

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[R]:
        self.requests.append(request)
        answer = self.answers[min(len(self.requests), len(self.answers)) - 1]
        for response in answer:
            yield response

    async def start(self, max_receive_bytes: int | None = None) -> None:
        options = (
            []
            if max_receive_bytes is None
            else [("grpc.max_receive_message_length", max_receive_bytes)]
        )
        self.server = grpc.aio.server(options=options)
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(None)


@pytest.fixture
async def hostile() -> AsyncIterator[HostileGateway]:
    gateway = HostileGateway()
    await gateway.start(max_receive_bytes=64 * KiB)
    yield gateway
    await gateway.stop()


@pytest.fixture
async def channel(hostile: HostileGateway) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(
        hostile.address, options=[("grpc.max_receive_message_length", 64 * KiB)]
    ) as opened:
        yield opened


def request(*messages: ModelMessage, system: str = "system") -> ModelRequest:
    return ModelRequest(
        project_id="demo",
        credential_ref="demo-credential",
        model="m",
        purpose=Purpose.TURN,
        system_prompt=system,
        messages=messages or (ModelMessage(Role.USER, "hello"),),
        tools=[],
        request_id="gen-1",
        deadlines=ModelDeadlines(5.0, 5.0, 10.0),
    )


async def collect(gateway: GrpcModelGateway, req: ModelRequest) -> list[Any]:
    return [chunk async for chunk in gateway.stream(req)]


def calls_of(chunks: list[Any]) -> list[tuple[int, str, str, str]]:
    return [
        (c.index, c.call.name, c.call.call_id, c.problem)
        for c in chunks
        if isinstance(c, ToolCallChunk)
    ]


# --------------------------------------------------------------------------- malformed calls


async def test_calls_are_numbered_in_the_order_they_start_whatever_the_gateways_indices(
    hostile: HostileGateway, channel: grpc.aio.Channel
) -> None:
    hostile.answers = [
        [
            start(0, "list_items", "a"),
            start(3, "list_runnable", "b"),  # a gap
            start(3, "list_runnable", "b"),  # the same start again
            start(9, "get_item", "c"),  # another gap
            call("list_items", call_id="a"),
            call("list_runnable", call_id="b"),
            call("get_item", '{"item_id": "PAN-4"}', call_id="c"),
            finish(),
        ]
    ]
    chunks = await collect(GrpcModelGateway(channel), request())
    starts = [(c.index, c.name) for c in chunks if isinstance(c, ToolCallStartChunk)]
    assert starts == [(0, "list_items"), (1, "list_runnable"), (2, "get_item")]
    assert calls_of(chunks) == [
        (0, "list_items", "a", ""),
        (1, "list_runnable", "b", ""),
        (2, "get_item", "c", ""),
    ]


async def test_a_call_started_but_never_sent_whole_is_yielded_with_its_problem(
    hostile: HostileGateway, channel: grpc.aio.Channel
) -> None:
    hostile.answers = [
        [start(0, "list_items", "a"), start(1, "get_item", "b"), call("list_items"), finish()]
    ]
    chunks = await collect(GrpcModelGateway(channel), request())
    (_, _, _, whole), (index, name, call_id, problem) = calls_of(chunks)
    assert whole == "" and (index, name, call_id) == (1, "get_item", "b")
    assert "never the call with its arguments" in problem
    # At the output limit, a call started but never sent is the one the limit cut: it is
    # yielded marked cut, never as runnable (decision 0292); a filtered answer yields none.
    hostile.answers = [[start(0, "get_item"), finish(gateway_pb2.FINISH_REASON_LENGTH)]]
    chunks = await collect(GrpcModelGateway(channel), request())
    assert calls_of(chunks) == [(0, "get_item", "", "")]
    assert [c.cut for c in chunks if isinstance(c, ToolCallChunk)] == [True]
    hostile.answers = [[start(0, "get_item"), finish(gateway_pb2.FINISH_REASON_CONTENT_FILTER)]]
    assert calls_of(await collect(GrpcModelGateway(channel), request())) == []


async def test_calls_without_a_start_a_name_or_an_id_pass_on_as_they_came(
    hostile: HostileGateway, channel: grpc.aio.Channel
) -> None:
    hostile.answers = [
        [
            start(0, "list_items", "dup"),
            call("list_items", call_id="dup"),
            call("", "not json", call_id="dup"),  # no start, no name, the same id
            call("list_runnable"),  # no start, no id
            finish(),
        ]
    ]
    chunks = await collect(GrpcModelGateway(channel), request())
    starts = [(c.index, c.name) for c in chunks if isinstance(c, ToolCallStartChunk)]
    assert starts == [(0, "list_items"), (1, ""), (2, "list_runnable")]
    assert calls_of(chunks) == [
        (0, "list_items", "dup", ""),
        (1, "", "dup", ""),
        (2, "list_runnable", "", ""),
    ]
    assert isinstance(chunks[-1], FinishChunk)


# --------------------------------------------------------------------------- sizes


def long_history(size: int) -> tuple[ModelMessage, ...]:
    return (
        ModelMessage(Role.USER, "tell me everything"),
        ModelMessage(Role.ASSISTANT, "x" * size),
        ModelMessage(Role.USER, "and now?"),
    )


async def test_a_gateway_that_refuses_a_request_for_its_size_gets_it_cut_to_its_limit(
    hostile: HostileGateway, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    hostile.answers = [[text("fine"), finish(gateway_pb2.FINISH_REASON_STOP)]]
    gateway = GrpcModelGateway(channel)  # told no limit: it learns the gateway's
    with caplog.at_level(logging.WARNING, logger="service.adapters.gateway"):
        chunks = await collect(gateway, request(*long_history(200 * KiB)))
    assert isinstance(chunks[-1], FinishChunk)
    (received,) = hostile.requests
    assert received.ByteSize() <= 64 * KiB
    assert received.messages[1].text.endswith(f"{200 * KiB} bytes in full]")
    assert received.messages[2].text == "and now?"
    assert any("max_message_bytes to 65536" in r.getMessage() for r in caplog.records)
    # The next request is cut before it is sent: no second refusal, no second warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="service.adapters.gateway"):
        await collect(gateway, request(*long_history(300 * KiB)))
    assert len(hostile.requests) == 2
    assert not any("refused" in r.getMessage() for r in caplog.records)


async def test_a_request_that_cannot_fit_is_model_request_too_large(
    hostile: HostileGateway, channel: grpc.aio.Channel
) -> None:
    hostile.answers = [[text("unused"), finish(gateway_pb2.FINISH_REASON_STOP)]]
    with pytest.raises(ModelFailure) as refused:
        await collect(GrpcModelGateway(channel), request(system="s" * (100 * KiB)))
    assert refused.value.reason == "MODEL_REQUEST_TOO_LARGE"
    assert "system prompt" in refused.value.message
    assert hostile.requests == []  # the gateway never saw it


async def test_an_answer_over_the_planners_receive_limit_is_model_output_too_large(
    hostile: HostileGateway, channel: grpc.aio.Channel
) -> None:
    hostile.answers = [[text("y" * (100 * KiB)), finish(gateway_pb2.FINISH_REASON_STOP)]]
    with pytest.raises(ModelFailure) as refused:
        await collect(GrpcModelGateway(channel), request())
    assert refused.value.reason == "MODEL_OUTPUT_TOO_LARGE"


# --------------------------------------------------------------------------- a whole turn


@pytest.fixture
async def hostile_rig(tmp_path: Path, hostile: HostileGateway) -> AsyncIterator[Rig]:
    started = await start_rig(
        tmp_path, settings={"DEPENDENCIES__GATEWAY__ADDRESS": hostile.address}
    )
    yield started
    await stop_rig(started)


async def test_a_turn_through_a_gateway_that_numbers_badly_runs_the_valid_calls(
    hostile: HostileGateway, hostile_rig: Rig
) -> None:
    hostile.answers = [
        [
            start(0, "list_items", "dup"),
            start(4, "list_runnable", "dup"),
            start(8, "get_item", "dup"),
            call("list_items", '{"kind": "epic"}', call_id="dup"),
            call("list_runnable", call_id="dup"),
            finish(),
        ],
        [text("Done."), finish(gateway_pb2.FINISH_REASON_STOP)],
    ]
    _, got = await hostile_rig.run_turn("What is there?")
    ended = events(got, "turn_ended")[0].turn_ended
    assert ended.reason == resources_pb2.TURN_END_REASON_COMPLETED, ended.error_message
    calls = [r.tool_call_started.message for r in events(got, "tool_call_started")]
    results = {
        r.tool_call_finished.message.tool_call_id: r.tool_call_finished.message
        for r in events(got, "tool_call_finished")
    }
    assert [c.tool_name for c in calls] == ["list_items", "list_runnable", "get_item"]
    assert [results[c.tool_call_id].tool_error for c in calls] == [False, False, True]
    assert error_reason(results[calls[2].tool_call_id].tool_result) == "MALFORMED_TOOL_CALL"
    # Three calls under one provider id go back to the model under the planner's ids.
    follow_up = hostile.requests[-1]
    sent = [c.id for m in follow_up.messages for c in m.tool_calls]
    answered = [m.tool_result.tool_call_id for m in follow_up.messages if m.role == 3]
    assert sent == answered == [c.tool_call_id for c in calls]
