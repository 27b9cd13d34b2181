"""An OTLP/gRPC trace sink for ``python -m bench --traced``: it accepts every batch and
keeps only counts.

It serves ``opentelemetry.proto.collector.trace.v1.TraceService`` (the messages and
service the OpenTelemetry exporter package ships) on a free loopback port, in the
driver's process, on a thread-pool server: ``Export`` counts the batch's spans and
answers an empty ``ExportTraceServiceResponse`` (full success, as the OTLP
specification says). Keeping nothing means a long run measures what tracing costs the
planner and the dependency stack, not what a test receiver's memory costs the driver.
"""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class OtlpSink(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    """The sink; ``start()`` returns the ``http://127.0.0.1:PORT`` endpoint to export to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: Any = None
        #: Spans received, and the export requests that carried them.
        self.spans = 0
        self.batches = 0

    def Export(
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        spans = sum(
            len(scope.spans)
            for resource in request.resource_spans
            for scope in resource.scope_spans
        )
        with self._lock:
            self.spans += spans
            self.batches += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._server = server
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(None)
            self._server = None
