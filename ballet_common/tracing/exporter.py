"""Tracing's export: the tracer provider of one service (``Tracing``), its exporters
stopped within the caller's grace period and their retries quieted at shutdown
(decision 0190)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from ballet_common.tracing.interceptors import TracingServerInterceptor, client_interceptors

#: One logger for the package, as before it was split.
log = logging.getLogger("ballet_common.tracing")

#: At most this many seconds go to exporting the spans still queued at shutdown; the
#: callers give less when their grace period has less left (decision 0190).
FLUSH_LIMIT_S = 2.0


class _QuietThreads(logging.Filter):
    """Drops the records of threads exporting for a ``Tracing`` that is shutting down:
    what the exporter would say there (each retry, each failure) ``Tracing.shutdown``
    says once."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread not in self.threads


QUIET_EXPORTS = _QuietThreads()
#: The logger of the OTLP exporter (its retries and failures), quieted at shutdown.
EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"


class StoppableExporter(SpanExporter):
    """A span exporter that ``Tracing.shutdown`` can stop from outside the batch
    processor's thread when the time for exporting is up (``shutdown``: the OTLP exporter
    then ends its retries and closes its channel, which ends an export in flight), and
    whose failures at shutdown it counts instead of logging each."""

    def __init__(self, exporter: SpanExporter) -> None:
        self._exporter = exporter
        self._lock = threading.Lock()
        self._threads: set[int] = set()
        self._stopping = False
        self._stopped = False
        #: Spans whose export failed once the shutdown began.
        self.dropped = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            self._threads.add(threading.get_ident())
            if self._stopping:
                QUIET_EXPORTS.threads.add(threading.get_ident())
        result = self._exporter.export(spans)
        if result is not SpanExportResult.SUCCESS:
            with self._lock:
                if self._stopping:
                    self.dropped += len(spans)
        return result

    def begin_shutdown(self) -> None:
        """From now on the exporter's threads are quiet and failures are counted."""
        with self._lock:
            self._stopping = True
            QUIET_EXPORTS.threads.update(self._threads)

    def shutdown(self) -> None:
        """Stop the exporter; idempotent (the batch processor calls it after ``stop``)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


@dataclass
class Tracing:
    """Tracing on: the tracer provider of one service and what traces its gRPC calls.

    ``tracer`` makes the spans; ``shutdown`` exports what is queued and stops.
    ``exporters`` are those ``shutdown`` stops when its time is up.
    """

    provider: TracerProvider
    tracer: trace.Tracer
    exporters: Sequence[StoppableExporter] = ()
    _ending: set[asyncio.Task[None]] = field(default_factory=set, repr=False)
    _stopped: asyncio.Future[None] | None = field(default=None, repr=False)
    _cut_short: bool = field(default=False, repr=False)
    _warned: bool = field(default=False, repr=False)

    def server_interceptor(self) -> grpc.aio.ServerInterceptor:
        """A SERVER span per inbound RPC, child of the caller's ``traceparent``."""
        return TracingServerInterceptor(self.tracer)

    def client_interceptors(self, address: str = "") -> list[grpc.aio.ClientInterceptor]:
        """A CLIENT span per outbound RPC on a channel to ``address`` (``host:port``,
        for the ``server.address`` attribute), its context sent as ``traceparent``."""
        return client_interceptors(self.tracer, address, self._ending)

    async def shutdown(self, timeout_s: float) -> bool:
        """Export the spans still queued, then stop, within ``timeout_s`` seconds and at
        most ``FLUSH_LIMIT_S`` (decision 0190: the process exits within its grace
        period, and a collector that is down must not hold an idle stop up).

        Returns whether every span was exported. Spans not exported in time (a collector
        that is down, refuses or hangs) are dropped with one WARNING for the whole
        shutdown, and the exporters are stopped (``StoppableExporter.shutdown``) so that no
        retry goes on behind the exit. A second call waits for the first, and cuts it
        short when its own time ends sooner. Never raises but ``CancelledError``.
        """
        timeout_s = min(max(0.0, timeout_s), FLUSH_LIMIT_S)
        if self._stopped is None:
            for exporter in self.exporters:
                exporter.begin_shutdown()
            self._stopped = self._stop()
        if not self._cut_short:
            try:
                await asyncio.wait_for(asyncio.shield(self._stopped), timeout_s)
            except TimeoutError:
                self._cut_short = True
                self._warn(f"spans not exported within {timeout_s:.1f} s at exit were dropped")
                for exporter in self.exporters:
                    # The OTLP exporter closes its channel here; off the event loop.
                    threading.Thread(
                        target=exporter.shutdown, name="tracing-stop", daemon=True
                    ).start()
                return False
        dropped = sum(exporter.dropped for exporter in self.exporters)
        if dropped:
            self._warn(f"{dropped} spans could not be exported at exit and were dropped")
        return not (self._cut_short or dropped)

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("tracing: %s", message)

    def _stop(self) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()

        def settle() -> None:
            if not finished.done():
                finished.set_result(None)

        def run() -> None:
            try:
                self.provider.shutdown()
            except Exception:  # the SDK logs its own export failures; shutdown is done
                log.debug("tracing: the tracer provider's shutdown failed", exc_info=True)
            finally:
                # RuntimeError: the loop closed first, and nobody waits any more.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(settle)

        threading.Thread(target=run, name="tracing-shutdown", daemon=True).start()
        return finished
