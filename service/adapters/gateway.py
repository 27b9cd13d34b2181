"""The ``ballet.llm.v1`` gateway client: the core's ``ModelGateway`` port.

Owns what the loop must not know (STYLE, Pydantic AI's split): the proto conversion, the
three model deadlines, the bounded retries, and the translation of upstream
``AioRpcError``s into ``ModelFailure`` (SPEC section 5, Deadlines and Retries; issue 11):

- **Deadlines.** The first-output deadline runs until the first progress of any kind
  (text, a tool-call start or argument fragment, reasoning activity), the idle deadline
  between two of them, and the total deadline over the whole call, retries included.
  Reasoning and argument fragments are not yielded to the core: they only keep the call
  alive. A missed deadline is ``MODEL_TIMEOUT`` with a message naming the deadline and
  its length.
- **Complete answers only.** Tool calls are yielded (``ToolCallChunk``) only when the
  finish says the answer ended whole (stop, tool calls, or unspecified from an older
  gateway); after ``length``, ``content_filter`` or ``refusal`` the ``FinishChunk`` says
  why and no call is yielded, so a cut call can never be run. A stream that ends without
  a finish, or with the gateway's ``truncated``, raises ``MODEL_STREAM_TRUNCATED``.
- **Retries**: ``UNAVAILABLE``, ``RESOURCE_EXHAUSTED`` whose ``ErrorInfo`` reason is
  ``RATE_LIMITED``, and a truncated stream; only while nothing was yielded to the core
  (reasoning alone yields nothing); at most ``RetryPolicy.max_attempts`` attempts; the
  wait is exponential backoff with full jitter, never below a floor, and at least the
  ``google.rpc.RetryInfo`` delay. A delay beyond ``RetryPolicy.retry_after_max_s``, or
  beyond the total deadline, is not waited for: the failure is raised at once.
- **Reasons**: a message over the channel's receive limit is ``MODEL_OUTPUT_TOO_LARGE``
  (as is an answer larger than ``max_answer_bytes``); ``RESOURCE_EXHAUSTED`` otherwise is
  ``QUOTA_EXCEEDED``; a refused credential is ``CREDENTIAL_EXPIRED``; what stays
  unavailable is ``MODEL_UNAVAILABLE`` (or ``RATE_LIMITED``); the rest is
  ``MODEL_ERROR``. Every message is scrubbed of credentials and cut short
  (``ballet_common.redact``) before it is raised, whatever the gateway did.

Model output is stored as received, except that NUL characters (which PostgreSQL text
cannot hold) become U+FFFD.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import grpc
from ballet.llm.v1 import gateway_pb2

from ballet_common.grpc.status import parse
from ballet_common.redact import scrub
from service.core.errors import ModelFailure
from service.core.model import Usage
from service.core.ports import (
    FinishChunk,
    FinishReason,
    ModelChunk,
    ModelDeadlines,
    ModelMessage,
    ModelRequest,
    Purpose,
    Role,
    TextChunk,
    ToolCall,
    ToolCallChunk,
    ToolCallStartChunk,
    ToolDeclaration,
)

#: How many characters of gateway text a ``ModelFailure`` message quotes.
MESSAGE_MAX_CHARS = 300

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
    gateway_pb2.FINISH_REASON_REFUSAL: FinishReason.REFUSAL,
}
_WHOLE = frozenset({FinishReason.STOP, FinishReason.TOOL_CALLS, FinishReason.UNSPECIFIED})


@dataclass(frozen=True)
class RetryPolicy:
    """How the client retries a model call (SPEC section 5, Retries). Seconds.

    The n-th retry waits ``max(backoff_floor_s, min(backoff_max_s, backoff_base_s *
    2**(n-1)) * jitter)`` with jitter uniform in [0, 1), and at least the gateway's
    ``RetryInfo`` delay; a ``RetryInfo`` above ``retry_after_max_s`` is not waited for.
    """

    max_attempts: int = 3
    backoff_floor_s: float = 0.5
    backoff_base_s: float = 1.0
    backoff_max_s: float = 8.0
    retry_after_max_s: float = 30.0


@dataclass
class _Attempt:
    """What one attempt did so far: whether it yielded to the core, and its calls."""

    yielded: bool = False
    progressed: bool = False
    answer_bytes: int = 0
    started: set[int] = field(default_factory=set)
    calls: list[ToolCall] = field(default_factory=list)


class GrpcModelGateway:
    """``ModelGateway`` over a ``grpc.aio`` channel to ``ballet.llm.v1.GatewayService``.

    ``metadata`` supplies per-call metadata (the planner's service credential).
    ``max_answer_bytes`` caps one answer's text and tool-call arguments (UTF-8 bytes; None:
    no cap), e.g. the gateway channel's message limit, which the answer must fit again
    when it is sent back in the next request. ``sleep`` and ``jitter`` are injectable so
    tests need no wall-clock waits.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        metadata: Callable[[], list[tuple[str, str]]] = list,
        sleep: Callable[[float], object] = asyncio.sleep,
        jitter: Callable[[], float] = random.random,
        retry: RetryPolicy | None = None,
        max_answer_bytes: int | None = None,
    ) -> None:
        # The request is serialized here (``to_wire``: the tool declarations once, not on
        # every call), so the call takes bytes.
        self._generate = channel.unary_stream(
            _GENERATE,
            request_serializer=_as_bytes,
            response_deserializer=gateway_pb2.GenerateResponse.FromString,
        )
        self._metadata = metadata
        self._sleep = sleep
        self._jitter = jitter
        self._retry = retry or RetryPolicy()
        self._max_answer_bytes = max_answer_bytes
        self._encodings = MessageEncodings()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelChunk]:
        """Stream one answer; raises ``ModelFailure`` (see the module docstring)."""
        wire = to_wire(request, self._encodings)
        deadline = time.monotonic() + request.deadlines.total_s
        policy = self._retry
        attempt = 0
        while True:
            attempt += 1
            state = _Attempt()
            try:
                async for chunk in self._attempt(wire, request.deadlines, deadline, state):
                    yield chunk
                return
            except ModelFailure as failure:
                if state.yielded or not failure.retryable:
                    raise
                if attempt >= policy.max_attempts:
                    raise _retried(failure, f"after {attempt} attempts") from failure
                wait = self._backoff(attempt)
                asked = failure.retry_after_s
                if asked is not None and asked > policy.retry_after_max_s:
                    raise _retried(
                        failure,
                        f"not retried: the gateway asked to wait {asked:g} s, more than "
                        f"{policy.retry_after_max_s:g} s",
                    ) from failure
                wait = max(wait, asked or 0.0)
                if time.monotonic() + wait >= deadline:
                    raise _retried(
                        failure,
                        f"not retried: waiting {wait:.1f} s would pass the "
                        f"{request.deadlines.total_s:g} s deadline of the model call",
                    ) from failure
                await self._await(self._sleep(wait))

    def _backoff(self, attempt: int) -> float:
        policy = self._retry
        backoff = min(policy.backoff_max_s, policy.backoff_base_s * 2.0 ** (attempt - 1))
        return max(policy.backoff_floor_s, backoff * self._jitter())

    @staticmethod
    async def _await(value: object) -> None:
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            await value

    async def _attempt(
        self,
        wire: bytes,
        deadlines: ModelDeadlines,
        deadline: float,
        state: _Attempt,
    ) -> AsyncIterator[ModelChunk]:
        if deadline - time.monotonic() <= 0:
            raise _out_of_time(deadlines)
        call = self._generate(wire, timeout=deadline - time.monotonic(), metadata=self._metadata())
        try:
            while True:
                response = await self._read(call, deadlines, deadline, state)
                if response is None:
                    raise ModelFailure(
                        "MODEL_STREAM_TRUNCATED",
                        "the model's answer was cut off: the gateway's stream ended "
                        "without a finish",
                        retryable=True,
                    )
                state.progressed = True
                for chunk in self._chunks(response, state):
                    if not isinstance(chunk, FinishChunk):
                        state.yielded = True
                    yield chunk
                if response.WhichOneof("chunk") == "finish":
                    return
        except grpc.aio.AioRpcError as error:
            raise translate_error(error, deadlines, mid_answer=state.yielded) from error
        finally:
            call.cancel()

    @staticmethod
    async def _read(
        call: object, deadlines: ModelDeadlines, deadline: float, state: _Attempt
    ) -> gateway_pb2.GenerateResponse | None:
        """The next response (None at the end of the stream), within the deadline that
        applies now."""
        wait = deadlines.idle_s if state.progressed else deadlines.first_delta_s
        left = deadline - time.monotonic()
        if left <= 0:
            raise _out_of_time(deadlines)
        read = call.read  # type: ignore[attr-defined]
        try:
            # A timeout scope, not wait_for: no task per message read.
            async with asyncio.timeout(min(wait, left)):
                response = await read()
        except TimeoutError as error:
            if left <= wait:
                raise _out_of_time(deadlines) from error
            if not state.progressed:
                raise ModelFailure(
                    "MODEL_TIMEOUT",
                    f"the model sent no output in {wait:g} s (the first-output deadline, "
                    "dependencies.model_first_delta_s)",
                ) from error
            raise ModelFailure(
                "MODEL_TIMEOUT",
                f"the model sent nothing for {wait:g} s after its last output (the idle "
                "deadline, dependencies.model_idle_s)",
            ) from error
        if response is grpc.aio.EOF:
            return None
        assert isinstance(response, gateway_pb2.GenerateResponse)
        return response

    def _chunks(self, response: gateway_pb2.GenerateResponse, state: _Attempt) -> list[ModelChunk]:
        kind = response.WhichOneof("chunk")
        if kind == "text_delta":
            text = response.text_delta.text
            self._count(state, text)
            return [TextChunk(_storable(text))] if text else []
        if kind == "tool_call_start":
            start = response.tool_call_start
            if start.index in state.started:
                return []
            state.started.add(start.index)
            return [ToolCallStartChunk(start.index, _storable(start.name))]
        if kind == "tool_call_delta":
            self._count(state, response.tool_call_delta.arguments)
            return []
        if kind == "tool_call":
            # Held until the finish says the answer ended whole.
            tc = response.tool_call
            index = len(state.calls)
            state.calls.append(
                ToolCall(_storable(tc.id), _storable(tc.name), _storable(tc.arguments))
            )
            if index in state.started:
                return []
            # An older gateway sends no starts: the complete call is its start.
            state.started.add(index)
            return [ToolCallStartChunk(index, _storable(tc.name))]
        if kind == "finish":
            return _finish(response.finish, state)
        # Reasoning activity, or a kind a newer gateway added: progress only.
        return []

    def _count(self, state: _Attempt, text: str) -> None:
        if self._max_answer_bytes is None:
            return
        state.answer_bytes += len(text.encode())
        if state.answer_bytes > self._max_answer_bytes:
            raise ModelFailure(
                "MODEL_OUTPUT_TOO_LARGE",
                f"the model's answer passed {self._max_answer_bytes} bytes, the most the "
                "gateway channel carries (dependencies.gateway.max_message_bytes)",
            )


def _finish(finish: gateway_pb2.Finish, state: _Attempt) -> list[ModelChunk]:
    if finish.reason == gateway_pb2.FINISH_REASON_TRUNCATED:
        raise ModelFailure(
            "MODEL_STREAM_TRUNCATED",
            "the model's answer was cut off: the provider's stream ended without a finish reason",
            retryable=True,
        )
    usage = (
        Usage(finish.usage.input_tokens, finish.usage.output_tokens)
        if finish.HasField("usage")
        else None
    )
    reason = _FINISH.get(finish.reason, FinishReason.UNSPECIFIED)
    chunks: list[ModelChunk] = []
    if reason in _WHOLE:
        chunks = [ToolCallChunk(call, index) for index, call in enumerate(state.calls)]
    chunks.append(FinishChunk(reason, usage))
    return chunks


def _out_of_time(deadlines: ModelDeadlines) -> ModelFailure:
    return ModelFailure(
        "MODEL_TIMEOUT",
        f"the model call ran out of time after {deadlines.total_s:g} s (the total deadline, "
        "dependencies.model_total_s, or what was left of the turn)",
    )


def _retried(failure: ModelFailure, why: str) -> ModelFailure:
    return ModelFailure(
        failure.reason,
        f"{failure.message} ({why})",
        retry_after_s=failure.retry_after_s,
    )


def _storable(text: str) -> str:
    """``text`` with NUL (U+0000) replaced by U+FFFD: PostgreSQL text cannot hold NUL, and
    a model that emits one must not fail the turn when its answer is stored."""
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


#: ``ballet.llm.v1.GatewayService/Generate``, as the generated stub names it.
_GENERATE = "/ballet.llm.v1.GatewayService/Generate"


def _as_bytes(wire: bytes) -> bytes:
    return wire


def to_wire(request: ModelRequest, encoded: MessageEncodings | None = None) -> bytes:
    """``to_proto(request)`` serialized, with the tool declarations serialized once per
    set of declarations (they are the same on every call of a replica; concatenated
    protobuf messages merge, and a repeated field's entries append), and, with
    ``encoded``, each message encoded once for as long as its object is reused."""
    if encoded is None:
        head = to_proto(request, with_tools=False).SerializeToString()
        messages = b""
    else:
        head = to_proto(replace(request, messages=()), with_tools=False).SerializeToString()
        messages = b"".join([encoded.field(message) for message in request.messages])
    return head + messages + _tools_wire(tuple(request.tools))


class MessageEncodings:
    """Each ``ModelMessage``'s encoding as one entry of ``GenerateRequest.messages``,
    kept by object identity for as long as the object lives (the core keeps a session's
    earlier turns as the same objects: ``service.core.conversation``; a weak reference
    drops the encoding with its message, so this holds no more than the core does).
    Used from one event loop."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[weakref.ref[ModelMessage], bytes]] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def field(self, message: ModelMessage) -> bytes:
        """The bytes of ``messages: [message]`` in a ``GenerateRequest``."""
        key = id(message)
        kept = self._kept.get(key)
        if kept is not None and kept[0]() is message:
            return kept[1]
        holder = gateway_pb2.GenerateRequest()
        _add_message(holder, message)
        encoded = holder.SerializeToString()
        # The callback runs when the message is freed, before its id can be reused.
        self._kept[key] = (weakref.ref(message, lambda _: self._kept.pop(key, None)), encoded)
        return encoded


@functools.lru_cache(maxsize=8)
def _tools_wire(tools: tuple[ToolDeclaration, ...]) -> bytes:
    return gateway_pb2.GenerateRequest(tools=[_tool(tool) for tool in tools]).SerializeToString()


def _tool(tool: ToolDeclaration) -> gateway_pb2.ToolDeclaration:
    return gateway_pb2.ToolDeclaration(
        name=tool.name,
        description=tool.description,
        parameters_json_schema=tool.parameters_json_schema,
    )


def to_proto(request: ModelRequest, *, with_tools: bool = True) -> gateway_pb2.GenerateRequest:
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
        _add_message(proto, message)
    if with_tools:
        proto.tools.extend(_tool(tool) for tool in request.tools)
    return proto


def _add_message(proto: gateway_pb2.GenerateRequest, message: ModelMessage) -> None:
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


def translate_error(
    error: grpc.aio.AioRpcError,
    deadlines: ModelDeadlines | None = None,
    *,
    mid_answer: bool = False,
) -> ModelFailure:
    """The one place an upstream gateway error becomes a ``ModelFailure``.

    ``deadlines`` names the total deadline in a ``DEADLINE_EXCEEDED`` message;
    ``mid_answer`` says output was already yielded (the message says the stream broke off,
    not that the model was never reached). The message is scrubbed (``ballet_common``).
    """
    code = error.code()
    failure = parse(error)
    reason, retry_after = failure.reason, failure.retry_after_s
    details = scrub(error.details() or code.name, MESSAGE_MAX_CHARS)
    if code == grpc.StatusCode.UNAVAILABLE:
        message = (
            f"the model's stream broke off mid-answer: {details}"
            if mid_answer
            else f"the model is unavailable: {details}"
        )
        return ModelFailure("MODEL_UNAVAILABLE", message, retryable=True, retry_after_s=retry_after)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if reason == "RATE_LIMITED":
            return ModelFailure(
                "RATE_LIMITED",
                f"the model's rate limit was reached: {details}",
                retryable=True,
                retry_after_s=retry_after,
            )
        if not reason and "larger than max" in details:
            # gRPC's own refusal of a message over the channel's receive limit: the
            # gateway sent it, but this side would not take it.
            return ModelFailure(
                "MODEL_OUTPUT_TOO_LARGE",
                "the gateway sent a message larger than the channel accepts "
                f"(dependencies.gateway.max_message_bytes): {details}",
            )
        return ModelFailure("QUOTA_EXCEEDED", f"the project's model quota is used up: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        if deadlines is not None:
            return _out_of_time(deadlines)
        return ModelFailure("MODEL_TIMEOUT", f"the model call ran out of time: {details}")
    if (
        code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
        or reason == "CREDENTIAL_EXPIRED"
    ):
        return ModelFailure(
            "CREDENTIAL_EXPIRED", f"the provider refused the project's credential: {details}"
        )
    return ModelFailure("MODEL_ERROR", f"{code.name}: {details}")
