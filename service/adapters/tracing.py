"""The core's ``Tracer`` on OpenTelemetry (decision 0190).

``OtelTracer`` opens spans on an OpenTelemetry tracer (``ballet_common.tracing``): each
current inside its ``with`` through OpenTelemetry's context, which asyncio tasks copy
when they are created, so a turn's task, its model stream and its tool calls nest under
the span that was current where they started. Exceptions are recorded by type only: an
exception's message may quote content.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

from opentelemetry import trace
from opentelemetry.trace import Link, Status, StatusCode

from service.core.tracing import Attributes, Span, SpanRef


class _OtelSpan:
    """The core's ``Span`` over an OpenTelemetry span."""

    __slots__ = ("_span",)

    def __init__(self, span: trace.Span) -> None:
        self._span = span

    def set_attributes(self, attributes: Attributes) -> None:
        self._span.set_attributes(attributes)

    def rename(self, name: str) -> None:
        self._span.update_name(name)

    def fail(self, reason: str) -> None:
        self._span.set_attribute("error.type", reason)
        self._span.set_status(Status(StatusCode.ERROR, reason))


class OtelTracer:
    """``service.core.tracing.Tracer`` on ``tracer`` (``ballet_common.tracing.Tracing``)."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def span(
        self,
        name: str,
        attributes: Attributes | None = None,
        *,
        links: Sequence[SpanRef] = (),
    ) -> AbstractContextManager[Span]:
        return self._span(name, attributes, links)

    @contextmanager
    def _span(
        self, name: str, attributes: Attributes | None, links: Sequence[SpanRef]
    ) -> Iterator[Span]:
        otel_links = [
            Link(ref.handle) for ref in links if isinstance(ref.handle, trace.SpanContext)
        ]
        with self._tracer.start_as_current_span(
            name,
            attributes=attributes,
            links=otel_links,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield _OtelSpan(span)
            except BaseException as error:
                if not isinstance(error, asyncio.CancelledError | GeneratorExit):
                    _OtelSpan(span).fail(type(error).__qualname__)
                raise

    def current(self) -> SpanRef | None:
        context = trace.get_current_span().get_span_context()
        return SpanRef(context) if context.is_valid else None
