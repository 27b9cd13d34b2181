"""The ``ballet.llm.v1`` gateway client: the core's ``ModelGateway`` port.

Owns what the loop must not know (STYLE, Pydantic AI's split): the proto conversion,
the three model deadlines (first delta, idle between deltas, total), the bounded retries,
and the translation of upstream ``AioRpcError``s into ``ModelFailure`` (SPEC section 5,
Deadlines and Retries):

- only ``UNAVAILABLE``, and ``RESOURCE_EXHAUSTED`` whose ``ErrorInfo`` reason is
  ``RATE_LIMITED`` (honouring ``google.rpc.RetryInfo``), are retried: at most 3 attempts,
  exponential backoff with full jitter, and only before the first delta;
- ``RESOURCE_EXHAUSTED`` otherwise is ``QUOTA_EXCEEDED``; a refused credential is
  ``CREDENTIAL_EXPIRED``; a missed deadline is ``MODEL_TIMEOUT``; what stays unavailable
  is ``MODEL_UNAVAILABLE``; the rest is ``MODEL_ERROR``.

Model output is stored as received, except that NUL characters (which PostgreSQL text
cannot hold) become U+FFFD.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable

import grpc
from ballet.llm.v1 import gateway_pb2, gateway_pb2_grpc
from google.rpc import error_details_pb2, status_pb2

from service.core.errors import ModelFailure
from service.core.model import Usage
from service.core.ports import (
    FinishChunk,
    FinishReason,
    ModelChunk,
    ModelRequest,
    Purpose,
    Role,
    TextChunk,
    ToolCall,
    ToolCallChunk,
)

MAX_ATTEMPTS = 3
_BASE_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 5.0

_ROLES = {
    Role.USER: gateway_pb2.ROLE_USER,
    Role.ASSISTANT: gateway_pb2.ROLE_ASSISTANT,
    Role.TOOL: gateway_pb2.ROLE_TOOL,
}
_PURPOSES = {
    Purpose.TURN: gateway_pb2.PURPOSE_TURN,
    Purpose.COMPACTION: gateway_pb2.PURPOSE_COMPACTION,
}
_FINISH = {
    gateway_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    gateway_pb2.FINISH_REASON_TOOL_CALLS: FinishReason.TOOL_CALLS,
    gateway_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    gateway_pb2.FINISH_REASON_CONTENT_FILTER: FinishReason.CONTENT_FILTER,
}


class GrpcModelGateway:
    """``ModelGateway`` over a ``grpc.aio`` channel to ``ballet.llm.v1.GatewayService``.

    ``metadata`` supplies per-call metadata (the planner's service credential).
    ``sleep`` and ``jitter`` are injectable so tests need no wall-clock waits.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        metadata: Callable[[], list[tuple[str, str]]] = list,
        sleep: Callable[[float], object] = asyncio.sleep,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        self._metadata = metadata
        self._sleep = sleep
        self._jitter = jitter

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelChunk]:
        """Stream one answer; raises ``ModelFailure`` (see the module docstring)."""
        proto = to_proto(request)
        deadline = time.monotonic() + request.deadlines.total_s
        attempt = 0
        while True:
            attempt += 1
            delivered = False
            try:
                async for chunk in self._attempt(proto, request, deadline):
                    delivered = True
                    yield chunk
                return
            except ModelFailure as failure:
                if delivered or not failure.retryable or attempt >= MAX_ATTEMPTS:
                    raise
                backoff = min(_MAX_BACKOFF_S, _BASE_BACKOFF_S * 2 ** (attempt - 1)) * self._jitter()
                wait = max(backoff, failure.retry_after_s or 0.0)
                if time.monotonic() + wait >= deadline:
                    raise ModelFailure(
                        "MODEL_TIMEOUT", "no time left to retry the model"
                    ) from failure
                await self._await(self._sleep(wait))

    @staticmethod
    async def _await(value: object) -> None:
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            await value

    async def _attempt(
        self, proto: gateway_pb2.GenerateRequest, request: ModelRequest, deadline: float
    ) -> AsyncIterator[ModelChunk]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ModelFailure("MODEL_TIMEOUT", "the model call ran out of time")
        call = self._stub.Generate(proto, timeout=remaining, metadata=self._metadata())
        first = True
        try:
            while True:
                wait = request.deadlines.first_delta_s if first else request.deadlines.idle_s
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    raise ModelFailure("MODEL_TIMEOUT", "the model call ran out of time")
                try:
                    response = await asyncio.wait_for(call.read(), timeout=wait)
                except TimeoutError as error:
                    what = "first delta" if first else "next delta"
                    raise ModelFailure(
                        "MODEL_TIMEOUT", f"the model sent no {what} in {wait:.1f} s"
                    ) from error
                if response is grpc.aio.EOF:
                    return
                first = False
                kind = response.WhichOneof("chunk")
                if kind == "text_delta":
                    yield TextChunk(_storable(response.text_delta.text))
                elif kind == "tool_call":
                    tc = response.tool_call
                    yield ToolCallChunk(
                        ToolCall(_storable(tc.id), _storable(tc.name), _storable(tc.arguments))
                    )
                elif kind == "finish":
                    usage = (
                        Usage(
                            response.finish.usage.input_tokens, response.finish.usage.output_tokens
                        )
                        if response.finish.HasField("usage")
                        else None
                    )
                    reason = _FINISH.get(response.finish.reason, FinishReason.UNSPECIFIED)
                    yield FinishChunk(reason, usage)
        except grpc.aio.AioRpcError as error:
            raise translate_error(error) from error
        finally:
            call.cancel()


def _storable(text: str) -> str:
    """``text`` with NUL (U+0000) replaced by U+FFFD: PostgreSQL text cannot hold NUL, and
    a model that emits one must not fail the turn when its answer is stored."""
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


def to_proto(request: ModelRequest) -> gateway_pb2.GenerateRequest:
    """Convert a ``ModelRequest`` to ``ballet.llm.v1.GenerateRequest``."""
    proto = gateway_pb2.GenerateRequest(
        project_id=request.project_id,
        credential_ref=request.credential_ref,
        model=request.model,
        purpose=_PURPOSES[request.purpose],
        system_prompt=request.system_prompt,
        request_id=request.request_id,
    )
    for message in request.messages:
        item = proto.messages.add(role=_ROLES[message.role])
        if message.role is Role.TOOL:
            item.tool_result.tool_call_id = message.tool_call_id
            item.tool_result.name = message.tool_name
            item.tool_result.content = message.text
            item.tool_result.is_error = message.is_error
        else:
            item.text = message.text
            for call in message.tool_calls:
                item.tool_calls.add(id=call.call_id, name=call.name, arguments=call.arguments)
    for tool in request.tools:
        proto.tools.add(
            name=tool.name,
            description=tool.description,
            parameters_json_schema=tool.parameters_json_schema,
        )
    return proto


def translate_error(error: grpc.aio.AioRpcError) -> ModelFailure:
    """The one place an upstream gateway error becomes a ``ModelFailure``."""
    code = error.code()
    reason, retry_after = _details(error)
    message = error.details() or code.name
    if code == grpc.StatusCode.UNAVAILABLE:
        return ModelFailure("MODEL_UNAVAILABLE", message, retryable=True, retry_after_s=retry_after)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if reason == "RATE_LIMITED":
            return ModelFailure("RATE_LIMITED", message, retryable=True, retry_after_s=retry_after)
        return ModelFailure("QUOTA_EXCEEDED", message)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ModelFailure("MODEL_TIMEOUT", message)
    if (
        code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
        or reason == "CREDENTIAL_EXPIRED"
    ):
        return ModelFailure("CREDENTIAL_EXPIRED", message)
    return ModelFailure("MODEL_ERROR", f"{code.name}: {message}")


def _details(error: grpc.aio.AioRpcError) -> tuple[str, float | None]:
    """The ``ErrorInfo`` reason and ``RetryInfo`` delay (seconds) of a rich status."""
    raw = next(
        (v for k, v in error.trailing_metadata() or () if k == "grpc-status-details-bin"), None
    )
    if not isinstance(raw, bytes):
        return "", None
    status = status_pb2.Status.FromString(raw)
    reason = ""
    retry_after: float | None = None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_after = retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9
    return reason, retry_after
