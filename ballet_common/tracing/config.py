"""Tracing's configuration: the ``OTEL_*`` variables read, checked and turned into a
``Tracing`` (decision 0190; the package's docstring has the whole story)."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

from ballet_common.tracing.exporter import (
    EXPORTER_LOGGER,
    QUIET_EXPORTS,
    StoppableExporter,
    Tracing,
)

#: One logger for the package, as before it was split.
log = logging.getLogger("ballet_common.tracing")

#: Either of these set (to an endpoint) turns tracing on, exporting OTLP over gRPC.
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
#: The OTLP transport; only ``grpc`` is supported.
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
#: The values of ``OTEL_TRACES_EXPORTER`` understood here (a comma-separated list).
EXPORTERS = ("otlp", "console", "none")
#: The instrumentation scope of every span this project makes.
SCOPE = "ballet"


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
            logging.getLogger(EXPORTER_LOGGER).addFilter(QUIET_EXPORTS)
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
