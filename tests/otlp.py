"""A real OTLP/gRPC trace receiver on loopback, for the tracing tests.

``OtlpReceiver`` serves ``opentelemetry.proto.collector.trace.v1.TraceService`` (the OTLP
protocol's messages and service as the SDK's exporter package ships them) on a free
loopback port, written from the OTLP specification: ``Export`` receives a batch of
``ResourceSpans`` and answers an empty ``ExportTraceServiceResponse`` (full success).
It can also behave as a collector in trouble does: ``refuse`` every batch with
``UNAVAILABLE`` (the status OTLP exporters retry with backoff), or ``hang`` without
answering until released (a collector that accepted the connection and stalls).

It runs on a thread-pool gRPC server, so a synchronous test (processes) and an asyncio
test (in-process planners) can both use it; ``wait_for`` waits on a condition the
handler notifies, never on a sleep.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Literal

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

Behaviour = Literal["accept", "refuse", "hang"]


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the receiver got it, with its resource's attributes."""

    resource: dict[str, str]
    span: trace_pb2.Span

    @property
    def service(self) -> str:
        return self.resource.get("service.name", "")

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_span_id(self) -> str:
        return self.span.parent_span_id.hex()

    def attributes(self) -> dict[str, Any]:
        """Attributes as Python values (strings, ints, bools, doubles, string lists)."""
        return {kv.key: _value(kv.value) for kv in self.span.attributes}


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    """The receiver; ``start()`` returns its ``http://127.0.0.1:PORT`` endpoint."""

    def __init__(self, behaviour: Behaviour = "accept") -> None:
        self.behaviour = behaviour
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self._changed = threading.Condition()
        self._release = threading.Event()
        self._server: Any = None
        #: ``http://127.0.0.1:PORT`` once started (``OTEL_EXPORTER_OTLP_ENDPOINT``).
        self.endpoint = ""

    def Export(
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._changed:
            self.requests.append(request)
            self._changed.notify_all()
        if self.behaviour == "refuse":
            context.abort(grpc.StatusCode.UNAVAILABLE, "the collector is overloaded")
        if self.behaviour == "hang":
            self._release.wait()
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> str:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        return self.endpoint

    def stop(self) -> None:
        self._release.set()
        if self._server is not None:
            self._server.stop(0).wait(10)

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order."""
        with self._changed:
            requests = list(self.requests)
        return list(_spans(requests))

    def wait_for(self, predicate: Callable[[OtlpReceiver], bool], timeout_s: float) -> bool:
        """Wait until ``predicate(self)`` holds (re-checked on every export) or
        ``timeout_s`` passes; returns whether it held."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout_s)


def _spans(requests: list[trace_service_pb2.ExportTraceServiceRequest]) -> Iterator[ReceivedSpan]:
    for request in requests:
        for resource_spans in request.resource_spans:
            resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    yield ReceivedSpan(resource, span)
