"""The turn loop's metrics: ``TurnObserver`` over the Prometheus ``Metrics``.

Kept apart from the core (which only knows the ``TurnObserver`` Protocol) so the loop
stays free of metric libraries; labels never carry session, turn, human or project ids
(docs/spec/operations.md).
"""

from __future__ import annotations

from service.core.model import TurnEndReason, Usage
from service.server.metrics import Metrics, bounded_reason


class PrometheusTurnObserver:
    """Records turns (failed ones by ErrorInfo reason, and their time to first delta),
    rounds, tool calls, model calls, tokens and compactions."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

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
        self._metrics.turns.labels(reason=reason.value).inc()
        if reason is TurnEndReason.FAILED:
            # ErrorInfo reasons are the planner's own constants; bounded all the same.
            self._metrics.turn_failures.labels(reason=bounded_reason(error_reason)).inc()
        self._metrics.turn_rounds.observe(rounds)
        if seconds is not None:
            self._metrics.turn_seconds.labels(reason=reason.value).observe(seconds)

    def first_delta(self, seconds: float) -> None:
        self._metrics.turn_first_delta_seconds.observe(seconds)

    def round_completed(self) -> None:
        self._metrics.rounds.inc()

    def tool_called(self, tool: str, outcome: str, seconds: float) -> None:
        self._metrics.tool_calls.labels(tool=tool, outcome=outcome).inc()
        self._metrics.tool_seconds.labels(tool=tool).observe(seconds)

    def model_called(
        self,
        purpose: str,
        outcome: str,
        seconds: float,
        usage: Usage | None,
        first_delta_s: float | None = None,
    ) -> None:
        self._metrics.model_seconds.labels(purpose=purpose, outcome=outcome).observe(seconds)
        if first_delta_s is not None:
            self._metrics.model_first_delta_seconds.labels(purpose=purpose).observe(first_delta_s)
        if usage is not None:
            self._metrics.tokens.labels(kind="input", purpose=purpose).inc(usage.input_tokens)
            self._metrics.tokens.labels(kind="output", purpose=purpose).inc(usage.output_tokens)

    def compacted(self) -> None:
        self._metrics.compactions.inc()

    def compaction_failed(self, reason: str) -> None:
        self._metrics.compaction_failures.labels(reason=reason).inc()

    def context_estimated(self, purpose: str, estimated: int, reported: int) -> None:
        self._metrics.context_estimate_ratio.labels(purpose=purpose).observe(estimated / reported)
