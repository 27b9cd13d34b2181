"""The ``ballet.llm.v1`` gateway client: the core's ``ModelGateway`` port.

Owns what the loop must not know (docs/contributing.md): the proto conversion, the
three model deadlines, the bounded retries, and the translation of upstream
``AioRpcError``s into ``ModelFailure`` (docs/spec/turn-loop.md, Deadlines and Retries):

- **Deadlines.** The first-output deadline runs until the first progress of any kind
  (text, a tool-call start or argument fragment, reasoning activity), the idle deadline
  between two of them, and the total deadline over the whole call, retries included.
  Reasoning and argument fragments are not yielded to the core: they only keep the call
  alive. A missed deadline is ``MODEL_TIMEOUT`` with a message naming the deadline and
  its length. One timer per attempt keeps them (decision 0397).
- **Sent when opened.** ``stream`` sends the request before it returns (decision 0396).
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
- **Requests that fit** (decision 0224): a request over ``max_request_bytes`` (the
  channel's message limit) is cut to fit before it is sent (``request_fit``). A gateway
  that refuses a request for its size names its own limit; the request is cut to that
  limit and sent once more, and every later request too (with one WARNING saying which
  setting to lower).
- **Reasons**: a request the gateway refuses for its size is ``MODEL_REQUEST_TOO_LARGE``;
  a message from the gateway over this side's receive limit is ``MODEL_OUTPUT_TOO_LARGE``
  (as is an answer larger than ``max_answer_bytes``); ``RESOURCE_EXHAUSTED`` otherwise is
  ``QUOTA_EXCEEDED``; a refused credential is ``CREDENTIAL_EXPIRED``; what stays
  unavailable is ``MODEL_UNAVAILABLE`` (or ``RATE_LIMITED``); the rest is
  ``MODEL_ERROR``. Every message is scrubbed of credentials and cut short
  (``ballet_common.redact``) before it is raised, whatever the gateway did.
- **Malformed calls** (decision 0223): calls are numbered in the order they start,
  whatever the gateway's indices; the n-th complete call completes the n-th start; a
  call started but never sent whole in an answer that ended whole is yielded with a
  ``problem``, so the model gets an error result for it. Empty names and ids pass on.

Model output is stored as received, except that NUL characters (which PostgreSQL text
cannot hold) become U+FFFD.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

import grpc
from ballet.llm.v1 import gateway_pb2

from ballet_common.grpc.status import parse
from ballet_common.redact import scrub
from service.adapters import request_fit
from service.adapters.gateway_wire import MessageEncodings, to_wire
from service.core.errors import ModelFailure
from service.core.model import Usage
from service.core.ports import (
    FinishChunk,
    FinishReason,
    ModelChunk,
    ModelDeadlines,
    ModelMessage,
    ModelRequest,
    TextChunk,
    ToolCall,
    ToolCallChunk,
    ToolCallStartChunk,
)

#: How many characters of gateway text a ``ModelFailure`` message quotes.
MESSAGE_MAX_CHARS = 300

log = logging.getLogger(__name__)

#: gRPC's own refusal of a message over a receive limit: "(<message bytes> vs. <limit>)";
#: its details start with "SERVER:" when the gateway refused the request, "CLIENT:" (or
#: nothing, with older gRPC) when this side refused what the gateway sent.
_TOO_LARGE = re.compile(r"(SERVER: )?Received message larger than max \((\d+) vs\. (\d+)\)")

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
    """How the client retries a model call (docs/spec/turn-loop.md, Retries). Seconds.

    The n-th retry waits ``max(backoff_floor_s, min(backoff_max_s, backoff_base_s *
    2**(n-1)) * jitter)`` with jitter uniform in [0, 1), and at least the gateway's
    ``RetryInfo`` delay; a ``RetryInfo`` above ``retry_after_max_s`` is not waited for.
    Retries stop when the waits would pass ``window_s`` in all (long enough for a local
    model server to restart, decision 0297), or after ``max_attempts`` attempts.
    """

    max_attempts: int = 10
    window_s: float = 15.0
    backoff_floor_s: float = 0.5
    backoff_base_s: float = 1.0
    backoff_max_s: float = 8.0
    retry_after_max_s: float = 30.0


#: One attempt's call of ``GatewayService.Generate``.
_Call = grpc.aio.UnaryStreamCall[bytes, gateway_pb2.GenerateResponse]


class _Watch:
    """The reads of one attempt's call within its deadlines: the first output, the idle
    time between two outputs, and the total (docs/spec/turn-loop.md, Deadlines).

    One timer per attempt keeps them, moved on as outputs arrive, instead of a timeout
    scope around every read (decision 0397: a scope reschedules a timer and looks up
    the task on each of the answer's messages). At a deadline the timer cancels the
    call; the read waiting on it then raises the deadline's ``ModelFailure``. A
    cancellation of the reading task itself goes through unchanged."""

    def __init__(self, call: _Call, deadlines: ModelDeadlines, deadline: float) -> None:
        self._call = call
        self._deadlines = deadlines
        #: The total deadline (``time.monotonic()`` seconds).
        self._deadline = deadline
        self._last = time.monotonic()
        self._progressed = False
        #: The deadline's failure, once one passed (the call is cancelled then).
        self.expired: ModelFailure | None = None
        self._loop = asyncio.get_running_loop()
        self._timer = self._arm(self._last)

    async def read(self) -> gateway_pb2.GenerateResponse | None:
        """The next response (None at the end of the stream); raises ``expired`` once a
        deadline passed."""
        if self.expired is not None:
            raise self.expired
        try:
            response = await self._call.read()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.expired is None or (task is not None and task.cancelling()):
                raise
            raise self.expired from None
        if response is grpc.aio.EOF:
            if self.expired is not None:
                raise self.expired
            return None
        now = time.monotonic()
        self._last = now
        if not self._progressed:
            # The first output: from now on the idle deadline, which may come before
            # the first-output one the timer waits for.
            self._progressed = True
            self._timer.cancel()
            self._timer = self._arm(now)
        assert isinstance(response, gateway_pb2.GenerateResponse)
        return response

    def close(self) -> None:
        self._timer.cancel()

    def _due(self) -> float:
        wait = self._deadlines.idle_s if self._progressed else self._deadlines.first_delta_s
        return min(self._deadline, self._last + wait)

    def _arm(self, now: float) -> asyncio.TimerHandle:
        """The timer, set for the deadline due after ``now``. Later outputs only move
        that deadline on: the timer, when it fires early, sets itself again."""
        return self._loop.call_later(max(0.0, self._due() - now), self._check)

    def _check(self) -> None:
        now = time.monotonic()
        due = self._due()
        if now < due:
            self._timer = self._arm(now)
            return
        self.expired = self._failure(due)
        self._call.cancel()

    def _failure(self, due: float) -> ModelFailure:
        deadlines = self._deadlines
        if due >= self._deadline:
            return _out_of_time(deadlines)
        if not self._progressed:
            return ModelFailure(
                "MODEL_TIMEOUT",
                f"the model sent no output in {deadlines.first_delta_s:g} s (the "
                "first-output deadline, dependencies.model_first_delta_s)",
            )
        return ModelFailure(
            "MODEL_TIMEOUT",
            f"the model sent nothing for {deadlines.idle_s:g} s after its last output (the "
            "idle deadline, dependencies.model_idle_s)",
        )


class _OpenedStream:
    """An answer's stream whose first call is open already (``GrpcModelGateway.stream``).

    Closing it cancels that call even when the stream was never read: an async
    generator never started runs no ``finally``, so its own close could not."""

    def __init__(self, chunks: AsyncGenerator[ModelChunk, None], call: _Call) -> None:
        self._chunks = chunks
        self._call = call

    def __aiter__(self) -> _OpenedStream:
        return self

    def __anext__(self) -> Awaitable[ModelChunk]:
        return self._chunks.__anext__()

    async def aclose(self) -> None:
        self._call.cancel()
        await self._chunks.aclose()


async def _failing(error: Exception) -> AsyncIterator[ModelChunk]:
    """A stream that raises ``error`` when read: the request could not be sent."""
    raise error
    yield  # an async generator, never reached


@dataclass
class _Attempt:
    """What one attempt did so far: whether it yielded to the core, and its calls.

    ``positions`` maps the gateway's start index of each call to the call's position in
    the answer (0, 1, ... in the order calls started, whatever the gateway's numbering);
    ``started`` holds the provider id and name of each position; ``calls`` the complete
    calls, the n-th completing position n (decision 0223)."""

    yielded: bool = False
    progressed: bool = False
    answer_bytes: int = 0
    #: The receive limit the gateway named when it refused the request for its size.
    gateway_limit: int | None = None
    positions: dict[int, int] = field(default_factory=dict)
    started: list[tuple[str, str]] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    #: Positions of the calls the gateway marked cut (``ToolCall.cut``, decision 0292).
    cut: set[int] = field(default_factory=set)


class GrpcModelGateway:
    """``ModelGateway`` over a ``grpc.aio`` channel to ``ballet.llm.v1.GatewayService``.

    ``metadata`` supplies per-call metadata (the planner's service credential).
    ``max_answer_bytes`` caps one answer's text and tool-call arguments (UTF-8 bytes; None:
    no cap), e.g. the gateway channel's message limit, which the answer must fit again
    when it is sent back in the next request. ``max_request_bytes`` is the largest
    request sent (bytes; None: no limit but the one a gateway names when it refuses one).
    ``sleep`` and ``jitter`` are injectable so tests need no wall-clock waits.
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
        max_request_bytes: int | None = None,
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
        self._max_request_bytes = max_request_bytes
        self._encodings = MessageEncodings()

    def stream(self, request: ModelRequest) -> AsyncIterator[ModelChunk]:
        """Stream one answer; reading it raises ``ModelFailure`` (see the module
        docstring).

        The request is sent now: the first attempt's call is opened before this returns,
        not when the stream is first read (decision 0396), so that a caller who opens a
        call ahead of other work (the early model calls) has the request on its way
        first. Closing the stream (``aclose``) cancels the call, whether it was read or
        not."""
        deadline = time.monotonic() + request.deadlines.total_s
        try:
            wire = self._wire(request)
            call = self._open(wire, request.deadlines, deadline)
        except Exception as error:  # raised where the caller reads, as before
            return _failing(error)
        return _OpenedStream(self._answer(request, wire, deadline, call), call)

    def _open(self, wire: bytes, deadlines: ModelDeadlines, deadline: float) -> _Call:
        """One attempt's call of ``wire``, opened (its request sent) now."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise _out_of_time(deadlines)
        return self._generate(wire, timeout=left, metadata=self._metadata())

    async def _answer(
        self, request: ModelRequest, wire: bytes, deadline: float, call: _Call | None
    ) -> AsyncGenerator[ModelChunk, None]:
        """The answer's chunks, the first attempt on ``call`` (already open), the
        retries on calls of their own."""
        policy = self._retry
        attempt = 0
        waited = 0.0
        refitted = False
        while True:
            attempt += 1
            state = _Attempt()
            try:
                if call is None:
                    call = self._open(wire, request.deadlines, deadline)
                async for chunk in self._attempt(call, wire, request.deadlines, deadline, state):
                    yield chunk
                return
            except ModelFailure as failure:
                call = None
                limit = state.gateway_limit
                if limit is not None and not refitted and limit < len(wire):
                    # Not a retry of the model: the same request, cut to what the gateway
                    # said it takes, from now on.
                    self._learn_limit(limit, len(wire))
                    wire = self._wire(request)
                    refitted = True
                    attempt -= 1
                    continue
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
                if waited + wait > policy.window_s:
                    raise _retried(
                        failure,
                        f"after {attempt} attempts in the {policy.window_s:g} s retry window "
                        "(dependencies.model_retry_window_s)",
                    ) from failure
                waited += wait
                if time.monotonic() + wait >= deadline:
                    raise _retried(
                        failure,
                        f"not retried: waiting {wait:.1f} s would pass the "
                        f"{request.deadlines.total_s:g} s deadline of the model call",
                    ) from failure
                await self._await(self._sleep(wait))

    def _wire(self, request: ModelRequest) -> bytes:
        """The request's bytes, cut to fit the request limit when over it."""
        wire = to_wire(request, self._encodings)
        limit = self._max_request_bytes
        if limit is None or len(wire) <= limit:
            return wire

        def size(messages: list[ModelMessage]) -> int:
            return len(to_wire(replace(request, messages=messages), self._encodings))

        fitted = request_fit.fit(request.messages, limit, size)
        if fitted is None:
            raise ModelFailure(
                "MODEL_REQUEST_TOO_LARGE",
                f"the model request is {len(wire)} bytes and cannot be cut to the gateway's "
                f"limit of {limit} (dependencies.gateway.max_message_bytes): the system "
                "prompt and the tool declarations alone are too large",
            )
        messages, cut = fitted
        log.warning(
            "a model request of %d bytes was cut to fit the gateway's limit of %d bytes: "
            "%d of its %d messages cut",
            len(wire),
            limit,
            cut,
            len(messages),
        )
        return to_wire(replace(request, messages=messages), self._encodings)

    def _learn_limit(self, limit: int, sent: int) -> None:
        if self._max_request_bytes is None or limit < self._max_request_bytes:
            log.warning(
                "the gateway refused a model request of %d bytes: it takes at most %d; "
                "requests are cut to fit that from now on (set "
                "dependencies.gateway.max_message_bytes to %d)",
                sent,
                limit,
                limit,
            )
            self._max_request_bytes = limit

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
        call: _Call,
        wire: bytes,
        deadlines: ModelDeadlines,
        deadline: float,
        state: _Attempt,
    ) -> AsyncIterator[ModelChunk]:
        watch = _Watch(call, deadlines, deadline)
        try:
            while True:
                response = await watch.read()
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
            if watch.expired is not None:
                raise watch.expired from error
            failure = translate_error(
                error, deadlines, mid_answer=state.yielded, request_bytes=len(wire)
            )
            if failure.reason == "MODEL_REQUEST_TOO_LARGE":
                state.gateway_limit = refused_limit(error)
            raise failure from error
        finally:
            watch.close()
            call.cancel()

    def _chunks(self, response: gateway_pb2.GenerateResponse, state: _Attempt) -> list[ModelChunk]:
        kind = response.WhichOneof("chunk")
        if kind == "text_delta":
            text = response.text_delta.text
            self._count(state, text)
            return [TextChunk(_storable(text))] if text else []
        if kind == "tool_call_start":
            start = response.tool_call_start
            if start.index in state.positions:
                return []  # the same call started again
            position = len(state.started)
            state.positions[start.index] = position
            state.started.append((_storable(start.id), _storable(start.name)))
            return [ToolCallStartChunk(position, _storable(start.name))]
        if kind == "tool_call_delta":
            self._count(state, response.tool_call_delta.arguments)
            return []
        if kind == "tool_call":
            # Held until the finish says the answer ended whole.
            tc = response.tool_call
            position = len(state.calls)
            state.calls.append(
                ToolCall(_storable(tc.id), _storable(tc.name), _storable(tc.arguments))
            )
            if tc.cut:
                state.cut.add(position)
            if position < len(state.started):
                return []
            # An older gateway sends no starts: the complete call is its start.
            state.started.append((_storable(tc.id), _storable(tc.name)))
            return [ToolCallStartChunk(position, _storable(tc.name))]
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
    if reason is FinishReason.LENGTH:
        # Stopped at the output limit (decision 0292): the calls the gateway sent are
        # passed on, those it marked cut marked so; a call started but never sent is
        # the one the limit cut.
        chunks = [
            ToolCallChunk(call, index, cut=index in state.cut)
            for index, call in enumerate(state.calls)
        ]
        for position in range(len(state.calls), len(state.started)):
            call_id, name = state.started[position]
            chunks.append(ToolCallChunk(ToolCall(call_id, name, ""), position, cut=True))
    elif reason in _WHOLE:
        chunks = [ToolCallChunk(call, index) for index, call in enumerate(state.calls)]
        # A call the gateway started but never sent whole, in an answer that ended whole:
        # the model made it, so it gets an error result rather than vanishing.
        for position in range(len(state.calls), len(state.started)):
            call_id, name = state.started[position]
            chunks.append(
                ToolCallChunk(ToolCall(call_id, name, ""), position, problem=_NEVER_SENT_WHOLE)
            )
    chunks.append(FinishChunk(reason, usage, model=_storable(finish.model)[:MAX_MODEL_CHARS]))
    return chunks


#: The longest served-model name kept (a server's model names are far shorter).
MAX_MODEL_CHARS = 200

_NEVER_SENT_WHOLE = (
    "the gateway sent the start of this tool call but never the call with its arguments"
)


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


def translate_error(
    error: grpc.aio.AioRpcError,
    deadlines: ModelDeadlines | None = None,
    *,
    mid_answer: bool = False,
    request_bytes: int | None = None,
) -> ModelFailure:
    """The one place an upstream gateway error becomes a ``ModelFailure``.

    ``deadlines`` names the total deadline in a ``DEADLINE_EXCEEDED`` message;
    ``mid_answer`` says output was already yielded (the message says the stream broke off,
    not that the model was never reached); ``request_bytes`` is the size of the request
    sent, which tells gRPC's refusal of the request from its refusal of an answer. The
    message is scrubbed (``ballet_common``).
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
        refused = _TOO_LARGE.search(error.details() or "") if not reason else None
        if refused is not None and (
            refused.group(1) is not None or int(refused.group(2)) == request_bytes
        ):
            # gRPC's own refusal, on the gateway's side, of the planner's request.
            return ModelFailure(
                "MODEL_REQUEST_TOO_LARGE",
                f"the gateway refused the planner's request of {refused.group(2)} bytes: it "
                f"takes at most {refused.group(3)} (dependencies.gateway.max_message_bytes "
                "must not exceed the gateway's receive limit)",
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
    if reason == "TOOLS_NOT_SUPPORTED":
        return ModelFailure(
            "TOOLS_NOT_SUPPORTED",
            "the model server refused the planner's tools (serve a model and chat template "
            f"that support tool calls; docs/operations.md): {details}",
        )
    return ModelFailure("MODEL_ERROR", f"{code.name}: {details}")


def refused_limit(error: grpc.aio.AioRpcError) -> int | None:
    """The receive limit in bytes a gateway named when it refused a request for its
    size (gRPC's "Received message larger than max (N vs. LIMIT)"), or None."""
    refused = _TOO_LARGE.search(error.details() or "")
    return int(refused.group(3)) if refused is not None else None
