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

The package: ``config`` (the ``OTEL_*`` variables and ``make_tracing``), ``exporter``
(``Tracing``: the provider, its exporters and their shutdown), ``interceptors`` (the
gRPC spans). Its names are re-exported here.
"""

from ballet_common.tracing.config import (
    ENDPOINT_VARIABLES,
    EXPORTERS,
    PROTOCOL_VARIABLES,
    SCOPE,
    TracingConfigError,
    check_endpoint,
    exporters_wanted,
    make_tracing,
    tracing_from_environment,
)
from ballet_common.tracing.exporter import FLUSH_LIMIT_S, StoppableExporter, Tracing
from ballet_common.tracing.interceptors import TracingServerInterceptor

__all__ = [
    "ENDPOINT_VARIABLES",
    "EXPORTERS",
    "FLUSH_LIMIT_S",
    "PROTOCOL_VARIABLES",
    "SCOPE",
    "StoppableExporter",
    "Tracing",
    "TracingConfigError",
    "TracingServerInterceptor",
    "check_endpoint",
    "exporters_wanted",
    "make_tracing",
    "tracing_from_environment",
]
