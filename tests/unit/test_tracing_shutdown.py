"""``Tracing.shutdown`` with a collector in trouble (decision 0190): the export of the
spans still queued gets at most ``FLUSH_LIMIT_S`` and never more than it is given; past
that the exporter is stopped (which ends an export in flight) and what was not sent is
dropped with one WARNING, the exporter's own complaints quieted.

The exporter double plays a collector that holds every export until the exporter is
shut down (as the OTLP exporter's call ends when its channel closes), or one that
refuses every batch, logging on the OTLP exporter's logger as that exporter does."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from ballet_common.tracing import StoppableExporter, Tracing, make_tracing
from ballet_common.tracing.exporter import EXPORTER_LOGGER, QUIET_EXPORTS

OTLP_LOG = logging.getLogger(EXPORTER_LOGGER)


class TroubledCollector(SpanExporter):
    """``hang``: every export waits until ``shutdown``; else every export fails."""

    def __init__(self, hang: bool) -> None:
        self.hang = hang
        self.exporting = threading.Event()
        self.stopped = threading.Event()
        self.shutdowns = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.exporting.set()
        OTLP_LOG.warning("Transient error StatusCode.UNAVAILABLE, retrying")
        if self.hang:
            self.stopped.wait()
        OTLP_LOG.error("Failed to export traces")
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.stopped.set()


def traced(collector: TroubledCollector) -> Tracing:
    OTLP_LOG.addFilter(QUIET_EXPORTS)
    processor = BatchSpanProcessor(StoppableExporter(collector), schedule_delay_millis=60_000)
    tracing = make_tracing("t", [processor], service_version="1")
    for name in ("one", "two"):
        tracing.tracer.start_span(name).end()
    return tracing


#: What the double logs on the OTLP exporter's logger.
DOUBLES_LINES = ("Transient error StatusCode.UNAVAILABLE, retrying", "Failed to export traces")


def warnings(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    """Warnings and errors logged during the test; on the OTLP exporter's logger only
    the double's own lines: a real exporter an earlier test left retrying in the
    background logs there too ("Failed to export traces to 127.0.0.1:...")."""
    return [
        (record.name, record.getMessage())
        for record in caplog.records
        if record.levelno >= logging.WARNING
        and (record.name != EXPORTER_LOGGER or record.getMessage() in DOUBLES_LINES)
    ]


async def test_a_hanging_collector_costs_the_queued_spans_and_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    collector = TroubledCollector(hang=True)
    tracing = traced(collector)
    caplog.set_level(logging.INFO)
    assert await tracing.shutdown(0.2) is False
    assert collector.stopped.wait(10), "the exporter was not stopped"
    # A second call (the planner's and dev's own) waits for nothing and says nothing.
    assert await tracing.shutdown(5) is False
    assert warnings(caplog) == [
        ("ballet_common.tracing", "tracing: spans not exported within 0.2 s at exit were dropped")
    ]
    assert collector.shutdowns == 1


async def test_failed_exports_at_exit_are_counted_in_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    collector = TroubledCollector(hang=False)
    tracing = traced(collector)
    caplog.set_level(logging.INFO)
    assert await tracing.shutdown(5) is False
    assert collector.exporting.is_set()
    assert warnings(caplog) == [
        ("ballet_common.tracing", "tracing: 2 spans could not be exported at exit and were dropped")
    ]


async def test_the_flush_never_gets_more_than_its_limit_or_less_than_zero() -> None:
    collector = TroubledCollector(hang=True)
    tracing = traced(collector)
    # A negative period (a grace period already spent) cuts the export at once.
    assert await tracing.shutdown(-1.0) is False
    assert collector.stopped.wait(10)
