"""OpenTelemetry tracing for the planner and the devstack (decision 0190).

``tracing_from_environment`` reads the process's standard ``OTEL_*`` variables (the
SDK's exporter and sampler read them there too) and returns a
``Tracing`` (an SDK tracer provider exporting OTLP over gRPC) or None. Tracing is off
unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) or
``OTEL_TRACES_EXPORTER`` is set, and off whenever ``OTEL_SDK_DISABLED=true``; off means
no tracer provider, no interceptor and no span anywhere: the callers install nothing.
The rest of the standard variables keep their standard meaning and are read by the SDK
itself: ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` (over the defaults given
here), ``OTEL_TRACES_SAMPLER``/``_ARG``, ``OTEL_BSP_*``, ``OTEL_EXPORTER_OTLP_*`` (endpoint,
headers, timeout, certificates, ``INSECURE``), ``OTEL_PROPAGATORS``.

``Tracing.server_interceptor`` and ``Tracing.client_interceptors`` trace gRPC calls: a
SERVER span per inbound RPC, child of the W3C ``traceparent`` the caller sent, and a
CLIENT span per outbound RPC, whose context travels in the call's ``traceparent``. They
are this project's own, not opentelemetry-instrumentation-grpc's: that package puts a
failed call's status details and exception messages on its spans, and details here can
quote content (the scripted gateway's "no rule matches" quotes the human's message; a
backend's NOT_FOUND quotes what the model asked for). These spans carry the method, the
status code and at most an exception's type, never a message (decision 0190).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode

from ballet_common.grpc.handlers import EndWatch, WatchingInterceptor

log = logging.getLogger(__name__)

#: Either of these set (to an endpoint) turns tracing on, exporting OTLP over gRPC.
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
#: The OTLP transport; only ``grpc`` is supported.
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
#: The values of ``OTEL_TRACES_EXPORTER`` understood here (a comma-separated list).
EXPORTERS = ("otlp", "console", "none")
#: The instrumentation scope of every span this project makes.
SCOPE = "ballet"
#: At most this many seconds go to exporting the spans still queued at shutdown; the
#: callers give less when their grace period has less left (decision 0190).
FLUSH_LIMIT_S = 2.0

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


class TracingConfigError(ValueError):
    """An ``OTEL_*`` variable asks for something this service cannot do; the message
    names the variable and what it accepts."""


def exporters_wanted(environ: Mapping[str, str]) -> list[str]:
    """The span exporters ``environ`` asks for (``otlp``, ``console``); empty: tracing
    off. Raises ``TracingConfigError`` for an exporter or OTLP protocol not supported."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    listed = environ.get("OTEL_TRACES_EXPORTER", "")
    names = [name.strip().lower() for name in listed.split(",") if name.strip()]
    if not names:
        # Unlike the SDK's own default (otlp), nothing is exported until asked for.
        names = ["otlp"] if any(environ.get(v, "").strip() for v in ENDPOINT_VARIABLES) else []
    unknown = [name for name in names if name not in EXPORTERS]
    if unknown:
        raise TracingConfigError(
            f"OTEL_TRACES_EXPORTER: {', '.join(unknown)} is not supported "
            f"(use {', '.join(EXPORTERS)})"
        )
    wanted = list(dict.fromkeys(name for name in names if name != "none"))
    if "otlp" in wanted:
        for variable in PROTOCOL_VARIABLES:
            protocol = environ.get(variable, "").strip().lower()
            if protocol and protocol != "grpc":
                raise TracingConfigError(
                    f"{variable}={protocol}: only grpc is supported (OTLP over gRPC)"
                )
            if protocol:
                break
        # As for the protocol, the traces-specific variable wins over the general one.
        for variable in ENDPOINT_VARIABLES:
            endpoint = environ.get(variable, "").strip()
            if endpoint:
                check_endpoint(variable, endpoint)
                break
    return wanted


#: A gRPC target without a scheme: ``host:port``, the host a name, IPv4 or ``[IPv6]``.
_HOST_PORT = re.compile(
    r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):(\d{1,5})"
)


def check_endpoint(variable: str, endpoint: str) -> None:
    """Refuse an OTLP/gRPC ``endpoint`` (the value of ``variable``) the exporter would only
    fail on at its first export, silently, long after start-up.

    Accepted (the OTLP exporter specification: a URL with scheme ``http`` or ``https``,
    and the forms the gRPC client takes): ``http://host[:port]``, ``https://host[:port]``,
    ``host:port`` and ``unix:/path``. Raises ``TracingConfigError`` naming the variable.
    """
    problem = ""
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme in ("http", "https"):
        try:
            port = parts.port
        except ValueError:
            problem = "its port is not a number from 1 to 65535"
        else:
            if not parts.hostname:
                problem = "it names no host"
            elif port == 0:
                problem = "its port is not a number from 1 to 65535"
    elif parts.scheme == "unix":
        if not endpoint.startswith("unix:/") or parts.netloc:
            problem = "a unix socket is unix:/absolute/path"
    else:
        match = _HOST_PORT.fullmatch(endpoint)
        if match is None:
            problem = "expected http://host:port, https://host:port, host:port or unix:/path"
        elif not 0 < int(match.group(1)) <= 65535:
            problem = "its port is not a number from 1 to 65535"
    if problem:
        # A URL's user information may hold a password: the value is shown without it.
        shown = endpoint if "@" not in endpoint else "(the value)"
        raise TracingConfigError(f"{variable}={shown}: not an OTLP/gRPC endpoint: {problem}")


def tracing_from_environment(
    service_name: str,
    *,
    service_version: str | None = None,
    instance_id: str = "",
) -> Tracing | None:
    """A ``Tracing`` as the process's ``OTEL_*`` variables ask, or None when they ask
    for none (see the module docstring).

    ``service_name``, ``service_version`` and ``instance_id`` are the resource's
    ``service.*`` attributes unless ``OTEL_SERVICE_NAME``/``OTEL_RESOURCE_ATTRIBUTES``
    say otherwise (the version defaults to the installed ``ballet-planner``'s). Raises
    ``TracingConfigError``.
    """
    wanted = exporters_wanted(os.environ)
    if not wanted:
        return None
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    processors: list[SpanProcessor] = []
    for name in wanted:
        if name == "otlp":
            # Imported here: a process that traces nothing never loads the exporter.
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter,
            )

            # Its retries and failures at shutdown are said once, by Tracing.shutdown.
            logging.getLogger(_EXPORTER_LOGGER).addFilter(_QUIET)
            processors.append(BatchSpanProcessor(StoppableExporter(OTLPSpanExporter())))
        else:
            processors.append(BatchSpanProcessor(StoppableExporter(ConsoleSpanExporter())))
    return make_tracing(
        service_name,
        processors,
        service_version=service_version or _installed_version(),
        instance_id=instance_id,
    )


def _installed_version() -> str:
    try:
        return importlib.metadata.version("ballet-planner")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def make_tracing(
    service_name: str,
    processors: Sequence[SpanProcessor],
    *,
    service_version: str,
    instance_id: str = "",
) -> Tracing:
    """A ``Tracing`` whose spans go to ``processors`` (tests give an in-memory one).

    The provider is this process's for this service alone, not the global one: ``dev``
    runs the planner and the devstack in one process, each under its own service name.
    The sampler is the SDK's (``OTEL_TRACES_SAMPLER``; default: parent-based, always on).
    """
    provider = TracerProvider(
        resource=_resource(service_name, service_version, instance_id),
        # Shut down by its owner within its grace period, never by an atexit hook that
        # could hold the process up to 30 s behind a collector that is down.
        shutdown_on_exit=False,
    )
    exporters: list[StoppableExporter] = []
    for processor in processors:
        provider.add_span_processor(processor)
        exporter = getattr(processor, "span_exporter", None)
        if isinstance(exporter, StoppableExporter):
            exporters.append(exporter)
    return Tracing(provider, provider.get_tracer(SCOPE, service_version), exporters)


def _resource(service_name: str, service_version: str, instance_id: str) -> Resource:
    attributes: dict[str, Any] = {
        "service.name": service_name,
        "service.version": service_version,
    }
    if instance_id:
        attributes["service.instance.id"] = instance_id
    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override the defaults.
    attributes.update(OTELResourceDetector().detect().attributes)
    return Resource.create(attributes)


class _QuietThreads(logging.Filter):
    """Drops the records of threads exporting for a ``Tracing`` that is shutting down:
    what the exporter would say there (each retry, each failure) ``Tracing.shutdown``
    says once."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread not in self.threads


_QUIET = _QuietThreads()
#: The logger of the OTLP exporter (its retries and failures), quieted at shutdown.
_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"


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
                _QUIET.threads.add(threading.get_ident())
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
            _QUIET.threads.update(self._threads)

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
        return [
            _UnaryUnary(self.tracer, address, self._ending),
            _UnaryStream(self.tracer, address, self._ending),
            _StreamUnary(self.tracer, address, self._ending),
            _StreamStream(self.tracer, address, self._ending),
        ]

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
