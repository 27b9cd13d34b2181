"""The turn loop's metrics: ``TurnObserver`` over the Prometheus ``Metrics``.

Kept apart from the core (which only knows the ``TurnObserver`` Protocol) so the loop
stays free of metric libraries; labels never carry session, turn, human or project ids
(docs/spec/operations.md).
"""

from __future__ import annotations

from typing import Any

from service.core.model import TurnEndReason, Usage
from service.server.metrics import Metrics, bounded_reason

#: Label children kept per observer at most (the label values are bounded sets: end
#: reasons, purposes, outcomes, tools); past it they are looked up each time.
MAX_CHILDREN = 1_000


#: Compaction failures that are not a refused answer: the call failed, or the turn's
#: budget could not pay for it.
NOT_REFUSALS = frozenset({"model", "budget"})


class PrometheusTurnObserver:
    """Records turns (failed ones by ErrorInfo reason, and their time to first delta),
    rounds, tool calls, model calls, tokens and compactions."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        # ``labels(...)`` validates, builds a key and takes a lock on every call: the
        # children are looked up once per label values and kept (decision 0343).
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def _child(self, metric: Any, *values: str) -> Any:
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = metric.labels(*values)
            if len(self._children) < MAX_CHILDREN:
                self._children[key] = child
        return child

    def turn_started(self) -> None:
        # ``running_turns`` is read from the turn service when scraped (main.py).
        pass

    def turn_ended(
        self,
        reason: TurnEndReason,
        error_reason: str,
        rounds: int = 0,
        seconds: float | None = None,
    ) -> None:
        m = self._metrics
        self._child(m.turns, reason.value).inc()
        if reason is TurnEndReason.FAILED:
            # ErrorInfo reasons are the planner's own constants; bounded all the same.
            self._child(m.turn_failures, bounded_reason(error_reason)).inc()
        m.turn_rounds.observe(rounds)
        if seconds is not None:
            self._child(m.turn_seconds, reason.value).observe(seconds)

    def first_delta(self, seconds: float) -> None:
        self._metrics.turn_first_delta_seconds.observe(seconds)

    def round_completed(self) -> None:
        self._metrics.rounds.inc()

    def tool_called(self, tool: str, outcome: str, seconds: float) -> None:
        m = self._metrics
        self._child(m.tool_calls, tool, outcome).inc()
        self._child(m.tool_seconds, tool).observe(seconds)

    def model_called(
        self,
        purpose: str,
        outcome: str,
        seconds: float,
        usage: Usage | None,
        first_delta_s: float | None = None,
    ) -> None:
        m = self._metrics
        self._child(m.model_seconds, purpose, outcome).observe(seconds)
        if first_delta_s is not None:
            self._child(m.model_first_delta_seconds, purpose).observe(first_delta_s)
        if usage is not None:
            self._child(m.tokens, "input", purpose).inc(usage.input_tokens)
            self._child(m.tokens, "output", purpose).inc(usage.output_tokens)

    def compacted(self) -> None:
        self._metrics.compactions.inc()

    def compaction_failed(self, reason: str) -> None:
        self._child(self._metrics.compaction_failures, reason).inc()
        if reason not in NOT_REFUSALS:
            self._child(self._metrics.compaction_refusals, reason).inc()

    def tools_not_seen(self) -> None:
        self._metrics.tools_not_seen.inc()

    def early_model_call(self, outcome: str) -> None:
        self._child(self._metrics.early_model_calls, outcome).inc()

    def context_estimated(self, purpose: str, estimated: int, reported: int) -> None:
        self._child(self._metrics.context_estimate_ratio, purpose).observe(estimated / reported)
