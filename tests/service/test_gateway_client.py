"""The planner's gateway client against the devstack gateway on a real loopback server:
conversion, deadlines, bounded retries and error translation (docs/spec/turn-loop.md)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from ballet.llm.v1 import gateway_pb2

from ballet_common.tokens import GATEWAY_AUDIENCE, Trust
from devstack.gateway import ScriptedProvider, add_gateway_service
from devstack.gateway.base import Provider, ProviderChunk
from devstack.gateway.base import TextChunk as ProviderText
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
    ToolCall,
    ToolCallChunk,
    ToolDeclaration,
)
from service.server.credentials import ServiceCredential


class Rig:
    def __init__(self) -> None:
        self.sleeps: list[float] = []
        self.provider = ScriptedProvider({"rules": []})
        self.server: grpc.aio.Server | None = None
        self.channel: grpc.aio.Channel | None = None
        self.requests: Any = None

    async def start(self, provider: Provider | None = None) -> GrpcModelGateway:
        self.server = grpc.aio.server()
        secret = b"gateway-client-tests-secret-0123456789"
        servicer = add_gateway_service(
            self.server, provider or self.provider, trust=Trust.dev(secret)
        )
        self.requests = servicer.requests
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")

        async def no_sleep(seconds: float) -> None:
            self.sleeps.append(seconds)

        credential = ServiceCredential(GATEWAY_AUDIENCE, dev_secret=secret)
        return GrpcModelGateway(
            self.channel, metadata=credential.metadata, sleep=no_sleep, jitter=lambda: 1.0
        )

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.server is not None:
            await self.server.stop(None)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    value = Rig()
    yield value
    await value.stop()


def request(**deadlines: float) -> ModelRequest:
    return ModelRequest(
        project_id="demo",
        credential_ref="demo-credential",
        model="m",
        purpose=Purpose.TURN,
        system_prompt="system",
        messages=[
            ModelMessage(Role.USER, "hello"),
            ModelMessage(Role.ASSISTANT, "", tool_calls=(ToolCall("c1", "list_items", "{}"),)),
            ModelMessage(Role.TOOL, '{"items": []}', tool_call_id="c1", tool_name="list_items"),
        ],
        tools=[ToolDeclaration("list_items", "d", '{"type":"object"}')],
        request_id="gen-1",
        deadlines=ModelDeadlines(
            deadlines.get("first", 5.0), deadlines.get("idle", 5.0), deadlines.get("total", 10.0)
        ),
    )


async def collect(gateway: GrpcModelGateway, req: ModelRequest) -> list[Any]:
    return [chunk async for chunk in gateway.stream(req)]


async def test_stream_converts_both_ways(rig: Rig) -> None:
    rig.provider.set_scenario(
        [
            {
                "match": {"last_role": "tool", "tool_name": "list_items"},
                "reply": {
                    "text": "abcdef",
                    "chunk_chars": 2,
                    "tool_calls": [{"name": "get_item", "arguments": {"item_id": "x"}}],
                    "usage": {"input_tokens": 7, "output_tokens": 3},
                },
            }
        ]
    )
    gateway = await rig.start()
    chunks = await collect(gateway, request())
    assert [c.text for c in chunks if isinstance(c, TextChunk)] == ["ab", "cd", "ef"]
    calls = [c.call for c in chunks if isinstance(c, ToolCallChunk)]
    assert calls[0].name == "get_item" and calls[0].arguments == '{"item_id":"x"}'
    finish = chunks[-1]
    assert isinstance(finish, FinishChunk) and finish.reason == "tool_calls"
    assert finish.usage is not None and finish.usage.total == 10
    sent = rig.requests[0]
    assert sent.project_id == "demo" and sent.credential_ref == "demo-credential"
    assert sent.messages[2].tool_result.tool_call_id == "c1"
    assert sent.tools[0].name == "list_items"


async def test_unavailable_is_retried_within_the_retry_window_then_fails(rig: Rig) -> None:
    # Decision 0297: retries go on while their waits fit the window (15 s), at most 10.
    rig.provider.set_scenario([{"reply": {"error": {"code": "UNAVAILABLE", "message": "down"}}}])
    gateway = await rig.start()
    with pytest.raises(ModelFailure) as failure:
        await collect(gateway, request())
    assert failure.value.reason == "MODEL_UNAVAILABLE"
    assert len(rig.requests) == len(rig.sleeps) + 1 >= 3
    assert sum(rig.sleeps) <= 15.0
    assert "attempts" in failure.value.message


async def test_rate_limit_honours_retry_info(rig: Rig) -> None:
    rig.provider.set_scenario(
        [
            {
                "reply": {
                    "error": {
                        "code": "RESOURCE_EXHAUSTED",
                        "message": "slow down",
                        "reason": "RATE_LIMITED",
                        "retry_after_ms": 1500,
                    }
                }
            }
        ]
    )
    gateway = await rig.start()
    with pytest.raises(ModelFailure):
        await collect(gateway, request(total=30.0))
    assert rig.sleeps and min(rig.sleeps) >= 1.5


async def test_quota_is_not_retried(rig: Rig) -> None:
    rig.provider.set_scenario(
        [
            {
                "reply": {
                    "error": {
                        "code": "RESOURCE_EXHAUSTED",
                        "message": "no",
                        "reason": "QUOTA_EXCEEDED",
                    }
                }
            }
        ]
    )
    gateway = await rig.start()
    with pytest.raises(ModelFailure) as failure:
        await collect(gateway, request())
    assert failure.value.reason == "QUOTA_EXCEEDED" and len(rig.requests) == 1


async def test_failure_after_the_first_delta_is_not_retried(rig: Rig) -> None:
    rig.provider.set_scenario(
        [
            {
                "reply": {
                    "text": "abcd",
                    "chunk_chars": 1,
                    "error": {"code": "UNAVAILABLE", "message": "cut"},
                    "error_after_deltas": 2,
                }
            }
        ]
    )
    gateway = await rig.start()
    seen: list[str] = []
    with pytest.raises(ModelFailure):
        async for chunk in gateway.stream(request()):
            if isinstance(chunk, TextChunk):
                seen.append(chunk.text)
    assert seen == ["a", "b"] and len(rig.requests) == 1


async def test_first_delta_deadline(rig: Rig) -> None:
    rig.provider.set_scenario([{"reply": {"text": "late", "delay_ms": 2000}}])
    gateway = await rig.start()
    with pytest.raises(ModelFailure) as failure:
        await collect(gateway, request(first=0.2))
    assert failure.value.reason == "MODEL_TIMEOUT"


async def test_no_matching_rule_is_a_model_error(rig: Rig) -> None:
    gateway = await rig.start()
    with pytest.raises(ModelFailure) as failure:
        await collect(gateway, request())
    assert failure.value.reason == "MODEL_ERROR" and len(rig.requests) == 1


class HeldProvider:
    """A provider that answers ``first`` (nothing by default), then nothing more until
    its call is cancelled; it tells when a request reached it and when its answer was
    closed."""

    def __init__(self, first: ProviderChunk | None = None) -> None:
        self.first = first
        self.started = asyncio.Event()
        self.closed = asyncio.Event()

    async def generate(self, request: gateway_pb2.GenerateRequest) -> AsyncIterator[ProviderChunk]:
        self.started.set()
        try:
            if self.first is not None:
                yield self.first
            await asyncio.Event().wait()
            yield  # type: ignore[misc]  # never reached: an async generator
        finally:
            self.closed.set()


async def test_the_request_is_sent_when_the_stream_is_opened(rig: Rig) -> None:
    """Decision 0396: the call is opened by ``stream`` itself, so a stream never read
    has its request at the gateway, and closing it unread cancels the call."""
    held = HeldProvider()
    gateway = await rig.start(held)
    stream = gateway.stream(request())
    await asyncio.wait_for(held.started.wait(), 5)
    assert len(rig.requests) == 1
    # The port's type is an AsyncIterator; the gateway's stream closes like a generator.
    aclose = getattr(stream, "aclose", None)
    assert aclose is not None
    await aclose()
    await asyncio.wait_for(held.closed.wait(), 5)


async def test_the_idle_deadline_cancels_a_call_gone_quiet(rig: Rig) -> None:
    """One timer keeps an attempt's deadlines (decision 0397): after the first output
    the idle deadline applies, though the first-output one is longer."""
    held = HeldProvider(ProviderText("a"))
    gateway = await rig.start(held)
    seen: list[str] = []
    started = asyncio.get_running_loop().time()
    with pytest.raises(ModelFailure) as failure:
        async for chunk in gateway.stream(request(first=5.0, idle=0.3)):
            if isinstance(chunk, TextChunk):
                seen.append(chunk.text)
    assert seen == ["a"]
    assert failure.value.reason == "MODEL_TIMEOUT" and "idle deadline" in failure.value.message
    assert asyncio.get_running_loop().time() - started < 3.0
    await asyncio.wait_for(held.closed.wait(), 5)


async def test_a_reader_cancelled_is_cancelled_not_timed_out(rig: Rig) -> None:
    """The deadlines' timer cancels the call; a cancellation of the reading task itself
    still reaches the reader as a cancellation."""
    held = HeldProvider()
    gateway = await rig.start(held)
    reading = asyncio.get_running_loop().create_task(collect(gateway, request(first=5.0)))
    await asyncio.wait_for(held.started.wait(), 5)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    await asyncio.wait_for(held.closed.wait(), 5)
