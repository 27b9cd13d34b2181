"""Every Prometheus metric of the planner, in one place (docs/spec/operations.md).

``Metrics`` owns its own ``CollectorRegistry`` (nothing is registered globally, so tests
and several planners in one process never collide); the composition root makes one and
passes it to whoever records. Labels never carry session, turn, human or project ids:
only bounded sets (tool names, outcomes, purposes, RPC method names, status codes).

``MetricsInterceptor`` records gRPC server metrics for every RPC, and
``start_metrics_server`` serves ``/metrics`` on ``server.metrics_address`` from
prometheus_client's HTTP server in its own thread.
"""

from __future__ import annotations

import asyncio
import platform
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

from ballet_common.grpc.handlers import EndWatch, WatchingInterceptor
from ballet_common.grpc.status import from_trailers
from service.config import split_address
from service.core.model import TurnEndReason
from service.core.retention import PassOutcome, PurgeReason
from service.version import version

#: Latency buckets in seconds, from a fast tool call to a long model answer.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: Estimate / reported tokens: 1 is exact; the estimator aims within 0.85 to 1.15.
ESTIMATE_RATIO_BUCKETS = (0.5, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15, 1.2, 1.3, 1.5, 2)
RPC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60)
#: A turn's time to first delta in seconds: fine around the objective (2.5 s,
#: docs/operations.md), whose bound must be a bucket for the SLO's ratio to be exact.
FIRST_DELTA_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 4, 5, 7.5, 10, 20, 30, 60)
#: What ``ballet_planner_database_errors_total{kind}`` counts
#: (``service.adapters.store.work.FAILURE_KINDS``).
DATABASE_ERROR_KINDS = ("unavailable", "pool_timeout", "unexpected")
#: An ErrorInfo reason as the planner spells them; anything else is counted as ``OTHER``,
#: so a label never takes an unbounded value.
_REASON = re.compile(r"[A-Z][A-Z0-9_]{0,63}")


class Metrics:
    """The planner's metrics, registered in ``self.registry``.

    Counters (``_total`` is added by prometheus_client):

    - ``ballet_planner_compactions_total``: compactions stored (docs/spec/compaction.md);
      ``ballet_planner_compaction_failures_total{reason}``: failed ones (logged, nothing
      stored but the turn's compaction usage), by ``service.core.summaries`` reason;
      ``ballet_planner_compaction_refusals_total{cause}``: the answers among them refused
      as a summary (``refusal``, ``error``, ``too_short``, ``empty``, ``echo``, ``verbatim``,
      ``not_shorter``, ``finish_<reason>``; decision 0294).
    - ``ballet_planner_tools_not_seen_total``: answers whose reported input tokens were far
      below what the tool declarations alone take: the server likely dropped the tools
      (decision 0297).
    - ``ballet_planner_early_model_calls_total{outcome}``: model calls opened while what
      they follow committed, a turn's start (decision 0380) or a round's last results
      (decision 0391): ``taken``, ``differed`` (cancelled, the turn made its own) or
      ``cancelled`` (the commit failed or was refused, or the turn ended first); the last
      two are model calls metered for nothing.
    - ``ballet_planner_turns_total{reason}``: turns ended, by ``TurnEndReason`` value
      (every value exported from the start, at 0);
      ``ballet_planner_turn_failures_total{reason}``: the ``failed`` ones by ErrorInfo
      reason (``MODEL_UNAVAILABLE``, ``QUOTA_EXCEEDED``, ``TURN_TIMEOUT``, ...).
    - ``ballet_planner_rounds_total``: tool rounds run.
    - ``ballet_planner_tool_calls_total{tool,outcome}``: ``ok`` or an error reason.
    - ``ballet_planner_tokens_total{kind,purpose}``: ``input``/``output`` x
      ``turn``/``compaction``.
    - ``ballet_planner_grpc_server_started_total{grpc_method}`` and
      ``ballet_planner_grpc_server_handled_total{grpc_method,grpc_code}``;
      ``ballet_planner_grpc_server_errors_total{grpc_method,grpc_code,reason}``: RPCs
      that ended with a status other than OK or CANCELLED, by the ErrorInfo reason of
      that status (``NONE`` without one), e.g. Chat streams refused
      ``TOO_MANY_STREAMS`` or ended ``SLOW_CONSUMER``.
    - ``ballet_planner_database_errors_total{kind}``: units of work of the store that
      failed (``DATABASE_ERROR_KINDS``: ``unavailable``, ``pool_timeout``,
      ``unexpected``), the health monitor's pings included.

    Histograms (seconds): ``ballet_planner_turn_first_delta_seconds`` (from a turn's
    start, its message accepted, to the first delta its clients are sent: text or a tool
    call's start; once per turn that streams one),
    ``ballet_planner_model_first_delta_seconds{purpose}``,
    ``ballet_planner_model_call_seconds{purpose,outcome}``,
    ``ballet_planner_tool_call_seconds{tool}``, ``ballet_planner_turn_seconds{reason}``,
    ``ballet_planner_grpc_server_handling_seconds{grpc_method}``; and
    ``ballet_planner_turn_rounds`` (rounds per turn), and
    ``ballet_planner_context_estimate_ratio{purpose}``: the calibrated estimate of a
    request made without reported usage over the input tokens then reported (1 is
    exact), so a provider whose tokenizer drifts from the rates shows.

    Build and runtime: ``ballet_planner_build_info{version,python}`` (always 1: the
    planner's version, as ``ballet-planner --version`` prints it, and Python's), and the
    standard collectors of prometheus_client: ``process_*`` (CPU seconds, resident and
    virtual memory, open and maximum file descriptors, start time; on Linux),
    ``python_info`` and ``python_gc_*`` (collections, collected and uncollectable
    objects per generation).

    Gauges: ``ballet_planner_open_streams``, ``ballet_planner_running_turns`` (on this
    replica), ``ballet_planner_dev_mode`` (1 in dev mode), ``ballet_planner_database_up``
    (1 while the health monitor's ping answers), ``ballet_planner_database_connections_in_use``
    (connections checked out of the pool; the notifier's LISTEN connection is not pooled),
    ``ballet_planner_database_connections_limit`` (the most the pools may check out),
    ``ballet_planner_ready`` (1 while health checking reports SERVING: readiness), and
    ``ballet_planner_grpc_server_max_concurrent_rpcs`` (``server.maximum_concurrent_rpcs``).

    Retention (``service/core/retention.py``; docs/retention.md), counted by the process
    that deleted: ``ballet_planner_retention_sessions_deleted_total{reason}`` and
    ``ballet_planner_retention_messages_deleted_total{reason}`` (``idle`` or
    ``erasure``), ``ballet_planner_retention_passes_total{outcome}`` (``completed``,
    ``skipped``: another process held the pass lock, ``failed``), and
    ``ballet_planner_retention_last_completed_pass_timestamp_seconds`` (Unix time; 0
    before the first).

    Cross-replica signals (PostgreSQL; decisions 0230-0232):
    ``ballet_planner_signals_total{outcome}`` (notifications handed on after the
    commits: ``sent``, ``failed``, ``dropped``),
    ``ballet_planner_notifications_handled_total{kind}`` (``events`` of the sessions
    streamed here, ``cancel``) and ``ballet_planner_notifications_healed_total`` (streamed
    sessions whose events the once-a-second read of their stored sequence delivered
    before any notification).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        # The same collectors prometheus_client puts in its global registry, in ours.
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)  # registers nothing off CPython
        self.build_info = Info(
            "ballet_planner_build",
            "The planner's build: its version and the Python it runs on.",
            registry=registry,
        )
        self.build_info.info({"version": version(), "python": platform.python_version()})
        self.compactions = Counter(
            "ballet_planner_compactions",
            "Context compactions stored.",
            registry=registry,
        )
        self.compaction_failures = Counter(
            "ballet_planner_compaction_failures",
            "Compactions that failed, by reason (model, refusal, error, too_short, empty, "
            "finish_<reason>); the model call went on uncompacted.",
            ["reason"],
            registry=registry,
        )
        self.compaction_refusals = Counter(
            "ballet_planner_compaction_refusals",
            "Compaction answers refused as a summary, by cause (echo, verbatim, not_shorter, "
            "refusal, error, too_short, empty, finish_<reason>); nothing was stored.",
            ["cause"],
            registry=registry,
        )
        self.tools_not_seen = Counter(
            "ballet_planner_tools_not_seen",
            "Answers whose reported input tokens were far below the tool declarations' "
            "size: the model server likely dropped the tools.",
            registry=registry,
        )
        self.early_model_calls = Counter(
            "ballet_planner_early_model_calls",
            "Model calls opened while what they follow committed (a turn's start, a "
            "round's last results), by outcome (taken, differed, cancelled).",
            ["outcome"],
            registry=registry,
        )
        self.context_estimate_ratio = Histogram(
            "ballet_planner_context_estimate_ratio",
            "The context estimate made without reported usage over the input tokens the "
            "provider then reported, by purpose (decision 0171).",
            ["purpose"],
            buckets=ESTIMATE_RATIO_BUCKETS,
            registry=registry,
        )
        self.turns = Counter(
            "ballet_planner_turns", "Turns ended, by end reason.", ["reason"], registry=registry
        )
        for reason in TurnEndReason:
            self.turns.labels(reason=reason.value)
        self.turn_failures = Counter(
            "ballet_planner_turn_failures",
            "Turns ended failed, by ErrorInfo reason (MODEL_UNAVAILABLE, QUOTA_EXCEEDED, "
            "TURN_TIMEOUT, DEPENDENCY_UNAVAILABLE, DATABASE_UNAVAILABLE, ...).",
            ["reason"],
            registry=registry,
        )
        self.turn_first_delta_seconds = Histogram(
            "ballet_planner_turn_first_delta_seconds",
            "Seconds from a turn's start (its message accepted) to the first delta its "
            "clients are sent: text, or a tool call's start.",
            buckets=FIRST_DELTA_BUCKETS,
            registry=registry,
        )
        self.rounds = Counter("ballet_planner_rounds", "Tool rounds run.", registry=registry)
        self.turn_rounds = Histogram(
            "ballet_planner_turn_rounds",
            "Tool rounds per ended turn.",
            buckets=(0, 1, 2, 3, 5, 8, 13, 21, 34),
            registry=registry,
        )
        self.turn_seconds = Histogram(
            "ballet_planner_turn_seconds",
            "Turn duration in seconds, by end reason.",
            ["reason"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tool_calls = Counter(
            "ballet_planner_tool_calls",
            "Tool calls, by tool and outcome (ok or an error reason).",
            ["tool", "outcome"],
            registry=registry,
        )
        self.tool_seconds = Histogram(
            "ballet_planner_tool_call_seconds",
            "Tool call latency in seconds, by tool.",
            ["tool"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.model_first_delta_seconds = Histogram(
            "ballet_planner_model_first_delta_seconds",
            "Seconds from a model request to its first delta, by purpose.",
            ["purpose"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.model_seconds = Histogram(
            "ballet_planner_model_call_seconds",
            "Model call duration in seconds, by purpose and outcome.",
            ["purpose", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "ballet_planner_tokens",
            "Tokens reported by the model provider, by kind and purpose.",
            ["kind", "purpose"],
            registry=registry,
        )
        self.open_streams = Gauge(
            "ballet_planner_open_streams", "Open Chat streams on this replica.", registry=registry
        )
        self.running_turns = Gauge(
            "ballet_planner_running_turns", "Turns running on this replica.", registry=registry
        )
        self.dev_mode = Gauge(
            "ballet_planner_dev_mode",
            "1 when tokens are checked with the dev secret (no key set configured).",
            registry=registry,
        )
        self.database_up = Gauge(
            "ballet_planner_database_up",
            "1 while the database answers the health monitor's ping.",
            registry=registry,
        )
        self.database_connections_in_use = Gauge(
            "ballet_planner_database_connections_in_use",
            "Database connections checked out of the pool (0 when idle: idle streams and "
            "finished turns hold none).",
            registry=registry,
        )
        self.database_connections_limit = Gauge(
            "ballet_planner_database_connections_limit",
            "The most database connections the pools may check out (database.pool_size + "
            "max_overflow, plus hot_pool_size on PostgreSQL).",
            registry=registry,
        )
        self.database_errors = Counter(
            "ballet_planner_database_errors",
            "Units of work of the store that failed, by kind: unavailable (unreachable, "
            "broken connection, deadlock), pool_timeout (no connection free in time), "
            "unexpected (an error the store does not translate).",
            ["kind"],
            registry=registry,
        )
        for kind in DATABASE_ERROR_KINDS:
            self.database_errors.labels(kind=kind)
        self.ready = Gauge(
            "ballet_planner_ready",
            "1 while health checking reports SERVING (readiness): the database answers and "
            "the planner is not shutting down.",
            registry=registry,
        )
        self.grpc_started = Counter(
            "ballet_planner_grpc_server_started",
            "RPCs started, by method.",
            ["grpc_method"],
            registry=registry,
        )
        self.grpc_handled = Counter(
            "ballet_planner_grpc_server_handled",
            "RPCs completed, by method and status code.",
            ["grpc_method", "grpc_code"],
            registry=registry,
        )
        self.grpc_seconds = Histogram(
            "ballet_planner_grpc_server_handling_seconds",
            "RPC duration in seconds, by method.",
            ["grpc_method"],
            buckets=RPC_BUCKETS,
            registry=registry,
        )
        self.grpc_errors = Counter(
            "ballet_planner_grpc_server_errors",
            "RPCs that ended with a status other than OK or CANCELLED, by method, code and "
            "the status's ErrorInfo reason (NONE without one).",
            ["grpc_method", "grpc_code", "reason"],
            registry=registry,
        )
        self.grpc_max_concurrent_rpcs = Gauge(
            "ballet_planner_grpc_server_max_concurrent_rpcs",
            "RPCs the server serves at once (server.maximum_concurrent_rpcs); gRPC refuses "
            "more with RESOURCE_EXHAUSTED before any handler runs.",
            registry=registry,
        )
        # Cross-replica signals (decisions 0230-0232).
        self.signals = Counter(
            "ballet_planner_signals",
            "Cross-replica notifications this process's stores handed on after their "
            "commits, by outcome (sent; failed: the send raised, logged; dropped: over the "
            "pending bound or at shutdown). Followers heal what is not sent within "
            "planner.heal_interval_s.",
            ["outcome"],
            registry=registry,
        )
        self.notifications_handled = Counter(
            "ballet_planner_notifications_handled",
            "Notifications this process's listener handled, by channel kind (events: of the "
            "sessions it streams, its own included; cancel).",
            ["kind"],
            registry=registry,
        )
        self.notifications_healed = Counter(
            "ballet_planner_notifications_healed",
            "Streamed sessions whose stored sequence a heal read found beyond every "
            "notification heard: events a lost or stalled notification held back.",
            registry=registry,
        )
        for outcome in ("sent", "failed", "dropped"):
            self.signals.labels(outcome)
        for kind in ("events", "cancel"):
            self.notifications_handled.labels(kind)
        # Retention: what the idle passes and erasures of this process deleted.
        self.retention_sessions_deleted = Counter(
            "ballet_planner_retention_sessions_deleted",
            "Sessions deleted with everything in them, by reason (idle, erasure).",
            ["reason"],
            registry=registry,
        )
        self.retention_messages_deleted = Counter(
            "ballet_planner_retention_messages_deleted",
            "Messages deleted with their sessions, by reason (idle, erasure).",
            ["reason"],
            registry=registry,
        )
        self.retention_passes = Counter(
            "ballet_planner_retention_passes",
            "Idle-session passes, by outcome (completed; skipped: another process held the "
            "retention lock; failed).",
            ["outcome"],
            registry=registry,
        )
        self.retention_last_completed_pass = Gauge(
            "ballet_planner_retention_last_completed_pass_timestamp_seconds",
            "Unix time of the last idle-session pass that completed (0: none yet).",
            registry=registry,
        )
        # Every label value from the start, so a planner that has deleted nothing yet
        # exports zeros rather than no series at all.
        for purge in PurgeReason:
            self.retention_sessions_deleted.labels(purge.value)
            self.retention_messages_deleted.labels(purge.value)
        for outcome in PassOutcome:
            self.retention_passes.labels(outcome.value)

    def watch_database(
        self,
        checked_out: Callable[[], int],
        limit: int,
        on_failure: Callable[[Callable[[str], object]], None],
    ) -> None:
        """Measure the database: ``checked_out()`` connections in use against the pools'
        ``limit``, and every failed unit of work by kind, reported through
        ``on_failure(callback)`` (``UnitsOfWork.on_failure`` of the store)."""
        self.database_connections_in_use.set_function(checked_out)
        self.database_connections_limit.set(limit)
        on_failure(lambda kind: self.database_errors.labels(kind=kind).inc())

    def count_signal(self, outcome: str, n: int) -> None:
        """Count ``n`` signals of ``outcome`` (a ``Signals.watch`` callback)."""
        self.signals.labels(outcome).inc(n)

    def count_notification(self, kind: str, n: int) -> None:
        """Count ``n`` notifications handled, or heals (a ``PgNotifier.watch`` callback)."""
        if kind == "healed":
            self.notifications_healed.inc(n)
        else:
            self.notifications_handled.labels(kind).inc(n)


def bounded_reason(reason: str) -> str:
    """``reason`` when it is spelt as an ErrorInfo reason (UPPER_SNAKE, at most 64
    characters), else ``OTHER``: a label value from a bounded set whatever the caller
    passes."""
    return reason if _REASON.fullmatch(reason) else "OTHER"


class PurgeRunMetrics:
    """What one ``ballet-planner purge`` run did, for a Prometheus Pushgateway (a
    CronJob's process ends before any scrape; docs/retention.md).

    Gauges of the run, in a registry of their own (none of the serving metrics):
    ``ballet_planner_purge_sessions_deleted`` and ``ballet_planner_purge_messages_deleted``
    (by the run), ``ballet_planner_purge_last_success_timestamp_seconds`` (Unix time the
    run succeeded; not set by a failed run, so staleness shows). Pushed under the
    grouping key ``job="ballet-planner-purge"`` and ``reason`` (``idle`` or
    ``erasure``), so an erasure never replaces the idle runs' values.
    """

    JOB = "ballet-planner-purge"

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.sessions_deleted = Gauge(
            "ballet_planner_purge_sessions_deleted",
            "Sessions the last purge run deleted.",
            registry=self.registry,
        )
        self.messages_deleted = Gauge(
            "ballet_planner_purge_messages_deleted",
            "Messages the last purge run deleted with their sessions.",
            registry=self.registry,
        )
        self.last_success = Gauge(
            "ballet_planner_purge_last_success_timestamp_seconds",
            "Unix time of the last purge run that succeeded.",
            registry=self.registry,
        )


def _reason(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The ErrorInfo reason of the status a handler aborted with (``NONE`` without one)."""
    try:
        failure = from_trailers(context.trailing_metadata())
    except Exception:  # the context may be gone with the call
        return "NONE"
    return bounded_reason(failure.reason) if failure is not None and failure.reason else "NONE"


class MetricsInterceptor(WatchingInterceptor):
    """Counts and times every RPC: ``grpc_server_started``/``handled``/``handling``, and
    ``grpc_server_errors`` by ErrorInfo reason.

    The status is ``OK`` when the handler returns, the code it aborted with, ``CANCELLED``
    when the call was cancelled, ``UNKNOWN`` for an exception that escaped.
    """

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def start(self, handler_call_details: Any) -> EndWatch:
        method = str(handler_call_details.method)
        self._metrics.grpc_started.labels(method).inc()
        started = time.perf_counter()

        def done(code: grpc.StatusCode, _error: str, context: Any) -> None:
            self._metrics.grpc_handled.labels(method, code.name).inc()
            self._metrics.grpc_seconds.labels(method).observe(time.perf_counter() - started)
            if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
                self._metrics.grpc_errors.labels(method, code.name, _reason(context)).inc()

        return done


@dataclass
class MetricsServer:
    """The running ``/metrics`` endpoint; ``address`` is ``host:port`` as bound."""

    address: str
    _server: Any

    async def stop(self) -> None:
        """Stop serving and close the socket.

        ``shutdown`` waits for the serving thread's next poll (up to 0.5 s), so it runs
        in a worker thread, never blocking the event loop.
        """
        await asyncio.to_thread(self._server.shutdown)
        self._server.server_close()


def start_metrics_server(metrics: Metrics, address: str) -> MetricsServer:
    """Serve ``metrics.registry`` on ``address`` (``host:port``; port 0 picks one) in a
    daemon thread. Raises ``OSError`` when the address cannot be bound."""
    host, port = split_address(address, "server.metrics_address")
    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    bound_port = server.server_address[1]
    shown_host = f"[{host}]" if ":" in host else host
    return MetricsServer(address=f"{shown_host}:{bound_port}", _server=server)
