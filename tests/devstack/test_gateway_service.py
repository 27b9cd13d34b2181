"""The gateway servicer: refusals, the usage ledger, recorded requests, rich errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from ballet.llm.v1 import gateway_pb2

from devstack.gateway import (
    FinishChunk,
    FinishReason,
    ProviderChunk,
    ScriptedProvider,
    TextChunk,
    ToolCallDeltaChunk,
    ToolCallStartChunk,
    Usage,
    UsageLedger,
    UsageRecord,
)
from tests.devstack.gateway_support import (
    PLANNER_METADATA,
    StartGateway,
    assistant,
    human,
    request,
)


class Scripted:
    """A provider answering from a list of chunks, counting its calls."""

    def __init__(self, *chunks: ProviderChunk) -> None:
        self.chunks = chunks
        self.calls = 0

    async def generate(self, req: gateway_pb2.GenerateRequest) -> AsyncIterator[ProviderChunk]:
        self.calls += 1
        for chunk in self.chunks:
            yield chunk


def without(req: gateway_pb2.GenerateRequest, field: str) -> gateway_pb2.GenerateRequest:
    req.ClearField(field)  # type: ignore[arg-type]
    return req


@pytest.mark.parametrize(
    ("req", "reason"),
    [
        (without(request(human("hi")), "project_id"), "PROJECT_REQUIRED"),
        (without(request(human("hi")), "credential_ref"), "CREDENTIAL_REF_REQUIRED"),
        (without(request(human("hi")), "purpose"), "PURPOSE_REQUIRED"),
        (request(human("hi"), gateway_pb2.Message(text="no role")), "ROLE_REQUIRED"),
    ],
)
async def test_incomplete_requests_are_refused(
    start_gateway: StartGateway, req: gateway_pb2.GenerateRequest, reason: str
) -> None:
    provider = Scripted(FinishChunk(FinishReason.STOP))
    gw = await start_gateway(provider)
    failure = await gw.fail(req)
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT
    assert failure.error_info.reason == reason
    assert failure.error_info.domain == "llm.ballet"
    assert provider.calls == 0
    assert gw.servicer.requests == [req]
    assert gw.servicer.ledger.records == []


async def test_every_request_is_recorded_in_order(start_gateway: StartGateway) -> None:
    gw = await start_gateway(ScriptedProvider([{"reply": {"text": "ok"}}]))
    first = request(human("one"), request_id="r1", model="gpt-x")
    first.tools.append(
        gateway_pb2.ToolDeclaration(name="list_runnable", parameters_json_schema="{}")
    )
    second = request(human("one"), assistant("ok"), human("two"), request_id="r2")
    refused = without(request(human("three")), "project_id")
    await gw.generate(first)
    await gw.generate(second)
    await gw.fail(refused)
    assert gw.servicer.requests == [first, second, refused]
    gw.servicer.reset()
    assert gw.servicer.requests == []


async def test_the_ledger_meters_finished_calls_per_project(start_gateway: StartGateway) -> None:
    provider = ScriptedProvider(
        [
            {
                "match": {"last_text_regex": "big"},
                "reply": {"text": "a", "usage": {"input_tokens": 100, "output_tokens": 20}},
            },
            {
                "match": {"last_text_regex": "small"},
                "reply": {"text": "b", "usage": {"input_tokens": 7, "output_tokens": 3}},
            },
            {
                "match": {"last_text_regex": "fail"},
                "reply": {"error": {"code": "UNAVAILABLE", "message": "down"}},
            },
            {"reply": {"text": "no usage"}},
        ]
    )
    gw = await start_gateway(provider)
    await gw.generate(request(human("big"), project_id="p1", request_id="a", model="m1"))
    await gw.generate(request(human("small"), project_id="p1", purpose="compaction"))
    await gw.fail(request(human("fail"), project_id="p1"))
    await gw.generate(request(human("other"), project_id="p2", credential_ref="cred-2"))

    ledger = gw.servicer.ledger
    assert ledger.totals("p1") == (2, 107, 23)
    calls, input_tokens, output_tokens = ledger.totals("p2")
    assert (calls, input_tokens, output_tokens) == (1, 0, 0)
    assert ledger.totals("unknown") == (0, 0, 0)
    assert ledger.records == [
        UsageRecord("p1", "cred-1", "turn", "m1", "a", Usage(100, 20)),
        UsageRecord("p1", "cred-1", "compaction", "", "", Usage(7, 3)),
        UsageRecord("p2", "cred-2", "turn", "", "", None),
    ]


def test_ledger_clear() -> None:
    ledger = UsageLedger()
    ledger.record(UsageRecord("p", "c", "turn", "m", "r", Usage(1, 2)))
    assert ledger.totals("p").input_tokens == 1
    ledger.clear()
    assert ledger.records == []
    assert ledger.totals("p") == (0, 0, 0)


async def test_errors_carry_error_info_and_retry_info(start_gateway: StartGateway) -> None:
    gw = await start_gateway(
        ScriptedProvider(
            [
                {
                    "match": {"last_text_regex": "quota"},
                    "reply": {
                        "error": {
                            "code": "RESOURCE_EXHAUSTED",
                            "message": "no quota left",
                            "reason": "QUOTA_EXCEEDED",
                        }
                    },
                },
                {
                    "reply": {
                        "error": {
                            "code": "UNAVAILABLE",
                            "message": "try later",
                            "retry_after_ms": 250,
                        }
                    }
                },
            ]
        )
    )
    quota = await gw.fail(request(human("quota")))
    assert quota.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert quota.status is not None
    assert quota.status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert quota.status.message == "no quota left"
    assert len(quota.status.details) == 1
    assert (quota.error_info.domain, quota.error_info.reason) == ("llm.ballet", "QUOTA_EXCEEDED")
    assert quota.retry_info is None

    later = await gw.fail(request(human("x")))
    assert later.code == grpc.StatusCode.UNAVAILABLE
    assert later.error_info.reason == "UNAVAILABLE"
    assert later.retry_info is not None
    assert later.retry_info.retry_delay.ToMilliseconds() == 250


class Broken:
    async def generate(self, req: gateway_pb2.GenerateRequest) -> AsyncIterator[ProviderChunk]:
        yield TextChunk("partial")
        raise RuntimeError("bug in a provider")


@pytest.mark.parametrize(
    "provider",
    [
        Broken(),
        Scripted(ToolCallDeltaChunk(0, "{}"), FinishChunk(FinishReason.STOP)),
        Scripted(ToolCallStartChunk(1, "c", "t"), FinishChunk(FinishReason.STOP)),
        Scripted(TextChunk("no finish")),
        Scripted(FinishChunk(FinishReason.STOP), TextChunk("after the end")),
    ],
    ids=["raises", "delta-before-start", "start-out-of-order", "no-finish", "chunk-after-finish"],
)
async def test_provider_bugs_are_internal_errors(
    start_gateway: StartGateway, provider: Broken | Scripted
) -> None:
    gw = await start_gateway(provider)
    failure = await gw.fail(request(human("hi")))
    assert failure.code == grpc.StatusCode.INTERNAL
    assert failure.error_info.reason == "PROVIDER_FAILED"
    assert gw.servicer.ledger.records == []


class Endless:
    """Sends one delta, then waits forever; records that its stream was closed."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def generate(self, req: gateway_pb2.GenerateRequest) -> AsyncIterator[ProviderChunk]:
        try:
            yield TextChunk("first")
            await asyncio.Event().wait()
        finally:
            self.closed.set()
        yield FinishChunk(FinishReason.STOP)


async def test_a_client_cancel_closes_the_provider_stream(start_gateway: StartGateway) -> None:
    provider = Endless()
    gw = await start_gateway(provider)
    call = gw.stub.Generate(request(human("hi")), metadata=PLANNER_METADATA)
    first = await call.read()
    assert isinstance(first, gateway_pb2.GenerateResponse)
    assert first.text_delta.text == "first"
    call.cancel()
    await asyncio.wait_for(provider.closed.wait(), timeout=5)
    assert gw.servicer.ledger.records == []
