"""Tracing's configuration (decision 0190): the standard ``OTEL_*`` variables,
off unless an endpoint or an exporter is named, and off at no cost."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ballet_common.tracing import (
    TracingConfigError,
    exporters_wanted,
    make_tracing,
    tracing_from_environment,
)
from service.adapters.store.work import UnitsOfWork
from service.adapters.tracing import OtelTracer
from service.config import ConfigError, load_settings
from service.core.tracing import NULL_TRACER
from service.core.turn import TurnDependencies
from service.server.root import planner_tracing


@pytest.mark.parametrize(
    ("environ", "wanted"),
    [
        ({}, []),
        ({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "console, otlp,otlp"}, ["console", "otlp"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, []),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, []),
        ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, []),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            ["otlp"],
        ),
        # The traces-specific protocol wins over the general one (the OTLP spec).
        (
            {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            },
            ["otlp"],
        ),
    ],
)
def test_the_variables_choose_the_exporters(environ: dict[str, str], wanted: list[str]) -> None:
    assert exporters_wanted(environ) == wanted


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER: zipkin"),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
            },
            "OTEL_EXPORTER_OTLP_PROTOCOL=http/json",
        ),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf",
        ),
    ],
)
def test_what_cannot_be_done_is_refused_naming_the_variable(
    environ: dict[str, str], named: str
) -> None:
    with pytest.raises(TracingConfigError, match=named):
        exporters_wanted(environ)


@pytest.mark.parametrize(
    "endpoint",
    [
        "http://127.0.0.1:4317",
        "https://collector.example.com",
        "http://[::1]:4317",
        "collector:4317",
        "[::1]:4317",
        "unix:///run/otel.sock",
    ],
)
def test_an_otlp_grpc_endpoint_is_accepted(endpoint: str) -> None:
    assert exporters_wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}) == ["otlp"]


@pytest.mark.parametrize(
    ("variable", "endpoint", "problem"),
    [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "not-a-url", "expected http://host:port"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "grpc://collector:4317", "expected http://host:port"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http//collector:4317", "expected http://host:port"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://:4317", "names no host"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:99999", "port is not a number"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:0", "port is not a number"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "unix://run/otel.sock", "unix:/absolute/path"),
    ],
)
def test_an_endpoint_the_exporter_cannot_use_is_refused_naming_the_variable(
    variable: str, endpoint: str, problem: str
) -> None:
    """It used to be accepted silently: every export then failed, unseen."""
    with pytest.raises(TracingConfigError, match=f"^{variable}=.*{problem}"):
        exporters_wanted({variable: endpoint})


def test_the_traces_endpoint_wins_and_a_password_is_never_shown() -> None:
    assert exporters_wanted(
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "unused-by-traces",
        }
    ) == ["otlp"]
    with pytest.raises(TracingConfigError) as refused:
        exporters_wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://me:hunter2@c:port"})
    assert "hunter2" not in str(refused.value)
    # Tracing off: the variable is not read, so not checked.
    assert exporters_wanted({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"}) == []


def without_otel(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("OTEL_")]:
        monkeypatch.delenv(name)


def test_the_planner_reports_a_bad_variable_as_a_configuration_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    without_otel(monkeypatch)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jaeger")
    settings = load_settings(None, {"BALLET_PLANNER__DATA_DIR": str(tmp_path)})
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER: jaeger is not supported"):
        planner_tracing(settings)


def test_off_by_default_builds_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    without_otel(monkeypatch)
    settings = load_settings(None, {"BALLET_PLANNER__DATA_DIR": str(tmp_path)})
    assert planner_tracing(settings) is None
    assert tracing_from_environment("ballet-devstack") is None
    # What the turns and the store get when no tracing is given: the no-op tracer.
    assert TurnDependencies.__dataclass_fields__["tracer"].default is NULL_TRACER


async def test_an_untraced_unit_of_work_runs_as_itself() -> None:
    """Tracing off adds nothing around a unit of work: its task runs the store method's
    own coroutine inside the one that settles its outcome (decision 0398), with no span's
    wrapper between them."""
    seen: list[str] = []

    async def work() -> None:
        task = asyncio.current_task()
        assert task is not None
        # The task's coroutine, and the one that awaits this one directly.
        seen.append(task.get_coro().__qualname__)  # type: ignore[union-attr]
        seen.append(sys._getframe(1).f_code.co_name)

    await UnitsOfWork().run(work(), "commit")
    assert seen == ["_settling", "_settling"]


async def test_units_of_work_are_traced_only_inside_a_traced_operation() -> None:
    exporter = InMemorySpanExporter()
    tracing = make_tracing("t", [SimpleSpanProcessor(exporter)], service_version="1")
    tracer = OtelTracer(tracing.tracer)
    units = UnitsOfWork(tracer)

    async def work() -> int:
        return 7

    # Background upkeep (lease renewal, the sweeper): no span of its own.
    assert await units.run(work(), "renew_lease") == 7
    with tracer.span("planner.turn"):
        assert await units.run(work(), "commit") == 7
    names = [(span.name, span.parent is not None) for span in exporter.get_finished_spans()]
    assert names == [("store.commit", True), ("planner.turn", False)]
    await tracing.shutdown(5)


def test_the_resource_names_the_service_unless_the_variables_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    tracing = make_tracing("ballet-planner", [], service_version="1.2", instance_id="r1")
    attributes = tracing.provider.resource.attributes
    assert attributes["service.name"] == "ballet-planner"
    assert attributes["service.version"] == "1.2"
    assert attributes["service.instance.id"] == "r1"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "planner-eu")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=prod")
    tracing = make_tracing("ballet-planner", [], service_version="1.2")
    attributes = tracing.provider.resource.attributes
    assert attributes["service.name"] == "planner-eu"
    assert attributes["deployment.environment.name"] == "prod"
