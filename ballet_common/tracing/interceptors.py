"""Tracing's gRPC interceptors: a SERVER span per inbound RPC, child of the caller's
``traceparent``, and a CLIENT span per outbound RPC, whose context travels in the call's
``traceparent``; the method, the status code and at most an exception's type, never a
message (decision 0190)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace import SpanKind, Status, StatusCode

from ballet_common.grpc.handlers import EndWatch, WatchingInterceptor

#: One logger for the package, as before it was split.
log = logging.getLogger("ballet_common.tracing")

#: Server codes that mark the span an error (OpenTelemetry's gRPC conventions: the rest
#: are the caller's doing, and the server answered as it should).
_SERVER_ERRORS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


# --------------------------------------------------------------------------- metadata


class _MetadataGetter(Getter[Iterable[Any]]):
    """Reads ``traceparent`` and friends from gRPC invocation metadata (pairs)."""

    def get(self, carrier: Iterable[Any], key: str) -> list[str] | None:
        values = [value for name, value in carrier if name == key and isinstance(value, str)]
        return values or None

    def keys(self, carrier: Iterable[Any]) -> list[str]:
        return [name for name, _ in carrier]


class _MetadataSetter(Setter[grpc.aio.Metadata]):
    """Writes ``traceparent`` and friends into outbound metadata, replacing any there."""

    def set(self, carrier: grpc.aio.Metadata, key: str, value: str) -> None:
        carrier[key] = value


_GETTER = _MetadataGetter()
_SETTER = _MetadataSetter()


def _method(method: str | bytes) -> tuple[str, str, str]:
    """``/pkg.Service/Method`` as (span name ``pkg.Service/Method``, service, method)."""
    if isinstance(method, bytes):
        method = method.decode(errors="replace")
    name = method.lstrip("/")
    service, _, rpc = name.partition("/")
    return name, service, rpc


def _rpc_attributes(method: str | bytes) -> tuple[str, dict[str, Any]]:
    name, service, rpc = _method(method)
    return name, {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc}


# --------------------------------------------------------------------------- server


@dataclass(frozen=True)
class _Active:
    """A server span, the context token that made it current, and the RPC's task."""

    span: trace.Span
    token: Any
    task: asyncio.Task[Any] | None


class TracingServerInterceptor(WatchingInterceptor):
    """A SERVER span per RPC: named ``pkg.Service/Method``, child of the W3C trace
    context in the call's metadata (an absent or malformed one starts a new trace),
    current while the handler runs (so what the handler starts, tasks included, is its
    child), ended with ``rpc.grpc.status_code``."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def start(self, handler_call_details: Any) -> EndWatch:
        metadata = tuple(handler_call_details.invocation_metadata or ())
        parent = propagate.extract(metadata, getter=_GETTER)
        name, attributes = _rpc_attributes(handler_call_details.method)
        span = self._tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attributes
        )
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        active = _Active(span, token, asyncio.current_task())
        return lambda code, error, _context: self._end(active, code, error)

    @staticmethod
    def _end(active: _Active, code: grpc.StatusCode, error: str) -> None:
        span = active.span
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code in _SERVER_ERRORS:
            span.set_attribute("error.type", error or code.name)
            span.set_status(Status(StatusCode.ERROR))
        span.end()
        # Each RPC runs in a task of its own, whose context ends with it: a handler's
        # generator finalized elsewhere (a stream its caller left) has nothing to detach.
        if asyncio.current_task() is active.task:
            otel_context.detach(active.token)


# --------------------------------------------------------------------------- client


class _Client:
    """A CLIENT span per call, child of the caller's current span, its context injected
    as ``traceparent``; ended when the call is done, whatever ends it (the caller may stop
    reading a stream and cancel it: that is not an error of the call)."""

    def __init__(self, tracer: trace.Tracer, address: str, ending: set[asyncio.Task[None]]):
        self._tracer = tracer
        self._attributes: dict[str, Any] = {}
        host, _, port = address.rpartition(":")
        if host and port.isdigit():
            self._attributes = {"server.address": host.strip("[]"), "server.port": int(port)}
        self._ending = ending

    def _start(self, details: Any) -> tuple[trace.Span, Any]:
        name, attributes = _rpc_attributes(details.method)
        span = self._tracer.start_span(
            name, kind=SpanKind.CLIENT, attributes={**attributes, **self._attributes}
        )
        metadata = grpc.aio.Metadata(*tuple(details.metadata or ()))
        propagate.inject(metadata, context=trace.set_span_in_context(span), setter=_SETTER)
        new_details = grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )
        return span, new_details

    async def _call(self, details: Any, start: Callable[[Any], Awaitable[Any]]) -> Any:
        span, new_details = self._start(details)
        try:
            call = await start(new_details)
        except BaseException as exc:
            code = getattr(exc, "code", None)
            if isinstance(exc, grpc.RpcError) and callable(code):
                span.set_attribute("rpc.grpc.status_code", code().value[0])
            span.set_attribute("error.type", type(exc).__qualname__)
            span.set_status(Status(StatusCode.ERROR))
            span.end()
            raise
        call.add_done_callback(lambda done: self._done(span, done))
        return call

    def _done(self, span: trace.Span, call: Any) -> None:
        # The code is read with an await; the span ends at the time the call did.
        ended = time.time_ns()
        task = asyncio.get_running_loop().create_task(self._finish(span, call, ended))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    @staticmethod
    async def _finish(span: trace.Span, call: Any, ended: int) -> None:
        try:
            code = await call.code()
        except BaseException:
            code = grpc.StatusCode.CANCELLED
        if not isinstance(code, grpc.StatusCode):
            code = grpc.StatusCode.UNKNOWN
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        locally_cancelled = code is grpc.StatusCode.CANCELLED and call.cancelled()
        if code is not grpc.StatusCode.OK and not locally_cancelled:
            span.set_attribute("error.type", code.name)
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=ended)


class _UnaryUnary(_Client, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return await self._call(client_call_details, lambda details: continuation(details, request))


class _UnaryStream(_Client, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return await self._call(client_call_details, lambda details: continuation(details, request))


class _StreamUnary(_Client, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, requests: Any
    ) -> Any:
        return await self._call(
            client_call_details, lambda details: continuation(details, requests)
        )


class _StreamStream(_Client, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, requests: Any
    ) -> Any:
        return await self._call(
            client_call_details, lambda details: continuation(details, requests)
        )


def client_interceptors(
    tracer: trace.Tracer, address: str, ending: set[asyncio.Task[None]]
) -> list[grpc.aio.ClientInterceptor]:
    """A CLIENT span per outbound RPC of each shape on a channel to ``address``; the
    tasks that end spans of calls still running are kept in ``ending``."""
    return [
        _UnaryUnary(tracer, address, ending),
        _UnaryStream(tracer, address, ending),
        _StreamUnary(tracer, address, ending),
        _StreamStream(tracer, address, ending),
    ]
