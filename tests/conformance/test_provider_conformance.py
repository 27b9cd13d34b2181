"""The provider conformance suite: every named behaviour of an OpenAI-compatible
server (tests/conformance/cases.py), played by our own double, run through the real
devstack gateway (gRPC on loopback, the ``openai`` provider pointed at the double) and
through the planner's ``GrpcModelGateway`` client on that gateway."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from ballet.llm.v1 import gateway_pb2, gateway_pb2_grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from ballet_common.tokens import Trust
from devstack.gateway import GatewayServicer, add_gateway_service
from devstack.gateway.openai_provider import OpenAIProvider
from service.adapters.gateway import GrpcModelGateway
from service.core.errors import ModelFailure
from service.core.ports import (
    FinishChunk,
    ModelDeadlines,
    ModelMessage,
    ModelRequest,
    Purpose,
    Role,
    TextChunk,
    ToolCallChunk,
    ToolCallStartChunk,
    ToolDeclaration,
)
from tests.conformance.cases import (
    CASES,
    CLIENT_ONLY,
    PLANTED_KEY,
    Case,
    Raised,
    Refused,
    Whole,
)
from tests.conformance.openai_double import (
    OpenAIDouble,
    Piece,
    Reply,
    call_fragment,
    calls_delta,
    chunk,
    event,
    usage_chunk,
)
from tests.devstack.gateway_support import PLANNER_METADATA, SECRET

_FINISH_NAMES = {
    gateway_pb2.FINISH_REASON_UNSPECIFIED: "unspecified",
    gateway_pb2.FINISH_REASON_STOP: "stop",
    gateway_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
    gateway_pb2.FINISH_REASON_LENGTH: "length",
    gateway_pb2.FINISH_REASON_CONTENT_FILTER: "content_filter",
    gateway_pb2.FINISH_REASON_REFUSAL: "refusal",
    gateway_pb2.FINISH_REASON_TRUNCATED: "truncated",
}


@dataclass
class Stack:
    double: OpenAIDouble
    servicer: GatewayServicer
    channel: grpc.aio.Channel
    stub: Any
    waits: list[float] = field(default_factory=list)

    def client(self) -> GrpcModelGateway:
        async def record(seconds: float) -> None:
            self.waits.append(seconds)

        # Jitter 0: every computed backoff is the floor, so the waits are exact.
        return GrpcModelGateway(
            self.channel,
            metadata=lambda: list(PLANNER_METADATA),
            sleep=record,
            jitter=lambda: 0.0,
        )


@pytest.fixture(scope="module")
async def stack() -> AsyncIterator[Stack]:
    double = OpenAIDouble()
    await double.start()
    provider = OpenAIProvider(
        base_url=double.base_url, api_key=PLANTED_KEY, model="double-1", timeout_s=30
    )
    server = grpc.aio.server()
    servicer = add_gateway_service(server, provider, trust=Trust.dev(SECRET))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield Stack(double, servicer, channel, gateway_pb2_grpc.GatewayServiceStub(channel))
    await channel.close()
    await server.stop(0)
    await provider.aclose()
    await double.stop()


def use(stack: Stack, case: Case) -> None:
    stack.double.reset(case.replies)
    stack.servicer.reset()
    stack.waits.clear()


def model_request(case: Case) -> ModelRequest:
    first, idle, total = case.deadlines
    return ModelRequest(
        project_id="demo",
        credential_ref="demo-credential",
        model="double-1",
        purpose=Purpose.TURN,
        system_prompt="You are the planner.",
        messages=[ModelMessage(Role.USER, "What are the open epics?")],
        tools=[ToolDeclaration("list_items", "List items.", '{"type":"object"}')],
        request_id=f"conformance-{case.name}",
        deadlines=ModelDeadlines(first, idle, total),
    )


def by_name(cases: list[Case]) -> Any:
    return pytest.mark.parametrize("case", cases, ids=[case.name for case in cases])


# --------------------------------------------------------------------------- the gateway


@by_name([c for c in CASES if c.name not in CLIENT_ONLY])
async def test_through_the_gateway(
    stack: Stack, case: Case, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    use(stack, case)
    request = gateway_pb2.GenerateRequest(
        project_id="demo",
        credential_ref="demo-credential",
        model="double-1",
        purpose=gateway_pb2.PURPOSE_TURN,
        messages=[gateway_pb2.Message(role=gateway_pb2.ROLE_USER, text="hi")],
    )
    responses: list[gateway_pb2.GenerateResponse] = []
    failure: grpc.aio.AioRpcError | None = None
    try:
        async for response in stack.stub.Generate(request, timeout=20, metadata=PLANNER_METADATA):
            responses.append(response)
    except grpc.aio.AioRpcError as error:
        failure = error
    kinds = [r.WhichOneof("chunk") for r in responses]
    if isinstance(case.gateway, Refused):
        assert failure is not None, kinds
        assert failure.code() == case.gateway.code
        status = rpc_status.from_call(failure)
        assert status is not None
        infos = [d for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
        assert len(infos) == 1
        info = error_details_pb2.ErrorInfo()
        infos[0].Unpack(info)
        assert (info.domain, info.reason) == ("llm.ballet", case.gateway.reason)
        for secret in case.secrets:
            assert secret not in (failure.details() or "")
            assert secret not in caplog.text
        return
    assert failure is None, failure
    expected: Whole = case.gateway
    assert kinds[-1] == "finish" and kinds.count("finish") == 1
    finish = responses[-1].finish
    assert _FINISH_NAMES[finish.reason] == expected.finish
    text = "".join(r.text_delta.text for r in responses if r.HasField("text_delta"))
    assert text == expected.text
    complete = [r.tool_call for r in responses if r.HasField("tool_call")]
    assert [(c.name, c.arguments) for c in complete] == list(expected.calls)
    assert tuple(c.cut for c in complete) == (expected.cut or (False,) * len(complete))
    # The served model as the server reported it (the double's chunks name it).
    if b'"model": "double-1"' in b"".join(p.data for r in case.replies for p in r.pieces):
        assert finish.model == "double-1"
    if expected.ids is not None:
        assert tuple(c.id for c in complete) == expected.ids
    else:
        assert len({c.id for c in complete}) == len(complete) and all(c.id for c in complete)
    # Complete calls come after every delta and only for a whole answer or one stopped at
    # its output limit; each call
    # streamed a start first, with the same id and name.
    starts = [r.tool_call_start for r in responses if r.HasField("tool_call_start")]
    if complete:
        assert [(s.id, s.name) for s in starts] == [(c.id, c.name) for c in complete]
        last_delta = max(i for i, k in enumerate(kinds) if k != "tool_call" and k != "finish")
        assert all(k == "tool_call" for k in kinds[last_delta + 1 : -1])
    assert [s.index for s in starts] == list(range(len(starts)))
    usage = (finish.usage.input_tokens, finish.usage.output_tokens)
    assert (usage if finish.HasField("usage") else None) == expected.usage


# --------------------------------------------------------------------------- the client


@by_name(CASES)
async def test_through_the_planners_client(
    stack: Stack, case: Case, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    use(stack, case)
    chunks: list[Any] = []
    failure: ModelFailure | None = None
    try:
        async for item in stack.client().stream(model_request(case)):
            chunks.append(item)
    except ModelFailure as error:
        failure = error
    text = "".join(c.text for c in chunks if isinstance(c, TextChunk))
    starts = [c for c in chunks if isinstance(c, ToolCallStartChunk)]
    calls = [c for c in chunks if isinstance(c, ToolCallChunk)]
    if case.waits is not None:
        assert tuple(stack.waits) == case.waits
    if isinstance(case.client, Raised):
        expected_failure = case.client
        assert failure is not None, chunks
        assert failure.reason == expected_failure.reason, failure.message
        assert expected_failure.message in failure.message
        assert text == expected_failure.text
        assert tuple(s.name for s in starts) == expected_failure.starts
        # A cut answer never yields a call the core could run.
        assert calls == [] and not any(isinstance(c, FinishChunk) for c in chunks)
        assert len(stack.double.received) == expected_failure.attempts
        for secret in case.secrets:
            assert secret not in failure.message
            assert secret not in caplog.text
        return
    assert failure is None, failure.message if failure else ""
    expected: Whole = case.client
    assert text == expected.text
    assert [(c.call.name, c.call.arguments) for c in calls] == list(expected.calls)
    assert [c.index for c in calls] == list(range(len(calls)))
    assert [(s.index, s.name) for s in starts] == [(c.index, c.call.name) for c in calls] or (
        not calls and expected.finish != "tool_calls"
    )
    assert tuple(c.cut for c in calls) == (expected.cut or (False,) * len(calls))
    if expected.ids is not None:
        assert tuple(c.call.call_id for c in calls) == expected.ids
    finish = chunks[-1]
    assert isinstance(finish, FinishChunk)
    assert finish.reason.value == expected.finish
    usage = (finish.usage.input_tokens, finish.usage.output_tokens) if finish.usage else None
    assert usage == expected.usage


async def test_every_case_has_a_distinct_name() -> None:
    names = [case.name for case in CASES]
    assert len(names) == len(set(names))


# --------------------------------------------------------------------------- every cut

_FULL = [
    chunk({"role": "assistant", "content": "Let me look."}),
    chunk(calls_delta(call_fragment(0, "call_1", "get_item", ""))),
    chunk(calls_delta(call_fragment(0, arguments='{"item_id":'))),
    chunk(calls_delta(call_fragment(0, arguments='"demo-1"}'))),
    chunk({}, "tool_calls"),
    usage_chunk(),
    "[DONE]",
]
_FINISH_AT = 4
_CUTS = [(k, half) for k in range(len(_FULL)) for half in (False, True)]


@pytest.mark.parametrize(
    ("events", "half"), _CUTS, ids=[f"{k}{'.5' if h else ''}" for k, h in _CUTS]
)
async def test_truncation_at_every_point(stack: Stack, events: int, half: bool) -> None:
    """A body cut after ``events`` whole events (and half of the next one) is a whole
    answer only when its finish reason arrived; otherwise the gateway says truncated, sends
    no complete call, and the client raises MODEL_STREAM_TRUNCATED without a call."""
    pieces = [Piece(event(c)) for c in _FULL[:events]]
    if half:
        whole_next = event(_FULL[events])
        pieces.append(Piece(whole_next[: len(whole_next) // 2]))
    case = Case(f"cut-{events}", [Reply(pieces=pieces, end="eof")], Whole(), Whole())
    use(stack, case)
    request = gateway_pb2.GenerateRequest(
        project_id="demo",
        credential_ref="demo-credential",
        model="double-1",
        purpose=gateway_pb2.PURPOSE_TURN,
        messages=[gateway_pb2.Message(role=gateway_pb2.ROLE_USER, text="hi")],
    )
    responses = [
        r async for r in stack.stub.Generate(request, timeout=20, metadata=PLANNER_METADATA)
    ]
    finish = responses[-1].finish
    complete = [r for r in responses if r.HasField("tool_call")]
    whole = events > _FINISH_AT
    assert _FINISH_NAMES[finish.reason] == ("tool_calls" if whole else "truncated")
    assert len(complete) == (1 if whole else 0)

    use(stack, case)
    chunks: list[Any] = []
    with contextlib.suppress(ModelFailure):
        async for item in stack.client().stream(model_request(case)):
            chunks.append(item)
    calls = [c for c in chunks if isinstance(c, ToolCallChunk)]
    if whole:
        assert [c.call.arguments for c in calls] == ['{"item_id":"demo-1"}']
        assert isinstance(chunks[-1], FinishChunk)
    else:
        assert calls == [] and not any(isinstance(c, FinishChunk) for c in chunks)
