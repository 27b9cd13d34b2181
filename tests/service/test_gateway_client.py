"""The planner's gateway client against the devstack gateway on a real loopback server:
conversion, deadlines, bounded retries and error translation (docs/spec/turn-loop.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from ballet_common.tokens import GATEWAY_AUDIENCE, Trust
from devstack.gateway import ScriptedProvider, add_gateway_service
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

    async def start(self) -> GrpcModelGateway:
        self.server = grpc.aio.server()
        secret = b"gateway-client-tests-secret-0123456789"
        servicer = add_gateway_service(self.server, self.provider, trust=Trust.dev(secret))
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
