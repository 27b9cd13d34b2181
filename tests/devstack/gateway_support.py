"""Builders and a gRPC harness for the LLM gateway tests (tests/devstack/test_gateway_*)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import cast

import grpc
from ballet.llm.v1 import gateway_pb2, gateway_pb2_grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from ballet_common.tokens import (
    GATEWAY_AUDIENCE,
    PLANNER_SERVICE_SUBJECT,
    Trust,
    mint_dev_service_token,
)
from devstack.gateway import (
    GatewayServicer,
    Provider,
    ProviderChunk,
    ToolCallChunk,
    ToolCallDeltaChunk,
    ToolCallStartChunk,
    add_gateway_service,
)

Metadata = tuple[tuple[str, str], ...]
#: The key these gateways trust, and the planner's credential signed with it.
SECRET = b"gateway-tests-dev-secret-0123456789abcdef"
PLANNER_METADATA = (
    (
        "x-ballet-service-authorization",
        "Bearer "
        + mint_dev_service_token(
            SECRET, PLANNER_SERVICE_SUBJECT, audiences=(GATEWAY_AUDIENCE,), ttl_s=24 * 3600
        ),
    ),
)

StartGateway = Callable[[Provider], Awaitable["GatewayHarness"]]
"""The `start_gateway` fixture: start a gateway over a provider, get its harness."""

PURPOSES = {"turn": gateway_pb2.PURPOSE_TURN, "compaction": gateway_pb2.PURPOSE_COMPACTION}


def assembled_calls(chunks: Sequence[ProviderChunk]) -> list[tuple[str, str, str]]:
    """The tool calls of a provider's chunks as (id, name, arguments), in index order,
    checking the order the provider port promises (a start before its deltas, starts
    numbered 0, 1, ...)."""
    calls: list[list[str]] = []
    for chunk in chunks:
        if isinstance(chunk, ToolCallStartChunk):
            assert chunk.index == len(calls), chunks
            calls.append([chunk.id, chunk.name, ""])
        elif isinstance(chunk, ToolCallDeltaChunk):
            assert chunk.index < len(calls), chunks
            calls[chunk.index][2] += chunk.arguments
        elif isinstance(chunk, ToolCallChunk):
            calls.append([chunk.id, chunk.name, chunk.arguments])
    return [(i, n, a) for i, n, a in calls]


def human(text: str) -> gateway_pb2.Message:
    return gateway_pb2.Message(role=gateway_pb2.ROLE_USER, text=text)


def assistant(text: str = "", calls: Sequence[tuple[str, str, str]] = ()) -> gateway_pb2.Message:
    """An assistant message; `calls` are (id, name, arguments)."""
    return gateway_pb2.Message(
        role=gateway_pb2.ROLE_ASSISTANT,
        text=text,
        tool_calls=[gateway_pb2.ToolCall(id=i, name=n, arguments=a) for i, n, a in calls],
    )


def tool(call_id: str, name: str, content: str, *, is_error: bool = False) -> gateway_pb2.Message:
    return gateway_pb2.Message(
        role=gateway_pb2.ROLE_TOOL,
        tool_result=gateway_pb2.ToolResult(
            tool_call_id=call_id, name=name, content=content, is_error=is_error
        ),
    )


def request(
    *messages: gateway_pb2.Message,
    purpose: str = "turn",
    project_id: str = "acme-demo",
    credential_ref: str = "cred-1",
    model: str = "",
    request_id: str = "",
) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        project_id=project_id,
        credential_ref=credential_ref,
        model=model,
        purpose=PURPOSES[purpose],
        system_prompt="You are the planner.",
        messages=list(messages),
        request_id=request_id,
    )


@dataclass
class Answer:
    """A Generate stream, read whole: its chunks in order."""

    responses: list[gateway_pb2.GenerateResponse]

    @property
    def deltas(self) -> list[str]:
        return [r.text_delta.text for r in self.responses if r.WhichOneof("chunk") == "text_delta"]

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    @property
    def tool_calls(self) -> list[gateway_pb2.ToolCall]:
        return [r.tool_call for r in self.responses if r.WhichOneof("chunk") == "tool_call"]

    @property
    def finish(self) -> gateway_pb2.Finish:
        last = self.responses[-1]
        assert last.WhichOneof("chunk") == "finish", last
        return last.finish

    @property
    def kinds(self) -> list[str]:
        return [str(r.WhichOneof("chunk")) for r in self.responses]


@dataclass
class Failure:
    """A Generate call that failed: its status, the chunks before it, and its details."""

    code: grpc.StatusCode
    message: str
    responses: list[gateway_pb2.GenerateResponse]
    status: status_pb2.Status | None

    @property
    def error_info(self) -> error_details_pb2.ErrorInfo:
        assert self.status is not None, "no google.rpc.Status in the trailers"
        infos = [d for d in self.status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
        assert len(infos) == 1, self.status
        info = error_details_pb2.ErrorInfo()
        infos[0].Unpack(info)
        return info

    @property
    def retry_info(self) -> error_details_pb2.RetryInfo | None:
        assert self.status is not None
        for detail in self.status.details:
            if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                info = error_details_pb2.RetryInfo()
                detail.Unpack(info)
                return info
        return None


@dataclass
class GatewayHarness:
    """A real grpc.aio server on 127.0.0.1 with the gateway servicer, and a client stub."""

    servicer: GatewayServicer
    stub: gateway_pb2_grpc.GatewayServiceAsyncStub
    address: str

    async def generate(
        self, req: gateway_pb2.GenerateRequest, metadata: Metadata = PLANNER_METADATA
    ) -> Answer:
        responses = [r async for r in self.stub.Generate(req, timeout=10, metadata=metadata)]
        return Answer(responses)

    async def fail(
        self, req: gateway_pb2.GenerateRequest, metadata: Metadata = PLANNER_METADATA
    ) -> Failure:
        responses: list[gateway_pb2.GenerateResponse] = []
        try:
            async for response in self.stub.Generate(req, timeout=10, metadata=metadata):
                responses.append(response)
        except grpc.aio.AioRpcError as exc:
            return Failure(exc.code(), exc.details() or "", responses, rpc_status.from_call(exc))
        raise AssertionError(f"the call succeeded: {responses}")


async def start_harness(
    provider: Provider,
) -> tuple[GatewayHarness, grpc.aio.Server, grpc.aio.Channel]:
    server = grpc.aio.server()
    servicer = add_gateway_service(server, provider, trust=Trust.dev(SECRET))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address)
    stub = cast(
        "gateway_pb2_grpc.GatewayServiceAsyncStub", gateway_pb2_grpc.GatewayServiceStub(channel)
    )
    return GatewayHarness(servicer, stub, address), server, channel
