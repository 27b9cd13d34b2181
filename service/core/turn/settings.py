"""What every turn of a replica shares, frozen: the limits (``TurnSettings``), the ports
and the tools (``TurnDependencies``), the metrics hooks (``TurnObserver``) and the
tracer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from service.core.estimate import TokenCalibration
from service.core.fanout import Hub
from service.core.model import TurnEndReason, Usage
from service.core.ports import (
    Clock,
    ModelGateway,
    RunningLimits,
    SessionStore,
    ToolBackends,
    ToolDeclaration,
    Tracer,
)
from service.core.projects import ProjectDirectory
from service.core.tools import ToolRunner
from service.core.tools.cut import MAX_ARGUMENT_BYTES, MAX_RESULT_BYTES
from service.core.tracing import NULL_TRACER


@dataclass(frozen=True)
class TurnSettings:
    """The limits a turn runs under (docs/configuration.md, docs/spec/turn-loop.md and
    docs/spec/operations.md).

    Times are seconds. ``max_rounds`` >= 1 and ``cancel_grace_s`` below the server's
    shutdown grace are checked by the settings loader.
    """

    model: str
    max_rounds: int = 8
    compact_at_tokens: int = 100_000
    compaction_input_max_tokens: int = 60_000
    summary_instructions: str = ""
    turn_timeout_s: float = 600.0
    cancel_grace_s: float = 5.0
    max_writes_per_turn: int = 5
    max_tool_calls_per_answer: int = 16
    #: The model's window, and the output caps and turn budgets (decision 0291).
    model_context_tokens: int = 128_000
    max_output_tokens: int = 2048
    compaction_max_output_tokens: int = 1024
    turn_max_model_requests: int = 32
    turn_max_tool_calls: int = 64
    turn_max_tokens: int = 1_000_000
    tool_concurrency: int = 4
    #: Arguments over this many UTF-8 bytes are not run, and stored cut to
    #: ``tool_arguments_cut_bytes`` (decision 0221).
    tool_arguments_max_bytes: int = MAX_ARGUMENT_BYTES
    tool_arguments_cut_bytes: int = MAX_RESULT_BYTES
    dependency_timeout_s: float = 10.0
    model_first_delta_s: float = 60.0
    model_idle_s: float = 60.0
    model_total_s: float = 300.0
    lease_s: float = 15.0
    sweep_interval_s: float = 5.0
    prompt_cache_s: float = 60.0
    message_max_bytes: int = 32 * 1024
    #: Bytes of the model's conversations kept between turns (``Conversations``; 0: none).
    conversation_cache_bytes: int = 64 << 20
    #: Queued turns per session (decision 0300).
    max_queued: int = 10
    running_limits: RunningLimits = field(default_factory=RunningLimits)


class TurnObserver(Protocol):
    """Metrics hooks of the turn loop; labels never carry session, turn, human or
    project ids (docs/spec/operations.md). Times are seconds."""

    def turn_started(self) -> None: ...

    def turn_ended(
        self,
        reason: TurnEndReason,
        error_reason: str,
        rounds: int = 0,
        seconds: float | None = None,
    ) -> None: ...

    def first_delta(self, seconds: float) -> None:
        """The turn's first delta (text, or a tool call's start) went to its streams
        ``seconds`` after the turn started; once per turn."""
        ...

    def compaction_failed(self, reason: str) -> None:
        """A compaction failed; ``reason`` is a bounded label (``service.core.summaries``:
        ``model``, ``budget``, ``refusal``, ``error``, ``too_short``, ``empty``, ``echo``,
        ``verbatim``, ``not_shorter``, ``finish_<reason>``)."""
        ...

    def tools_not_seen(self) -> None:
        """An answer's reported input tokens were far below what the tool declarations
        alone take: the model server likely dropped the tools (decision 0297)."""
        ...

    def early_model_call(self, outcome: str) -> None:
        """A model call opened while what it follows committed, a turn's start
        (decision 0380) or a round's last results (decision 0391), ended its life as
        ``outcome``: ``taken`` (the turn used it), ``differed`` (the turn's request was
        another: cancelled, the turn made its own) or ``cancelled`` (the commit failed or
        was refused, or the turn ended before the call)."""
        ...

    def context_estimated(self, purpose: str, estimated: int, reported: int) -> None:
        """A request estimated at ``estimated`` tokens without reported usage was
        reported as ``reported`` input tokens (decision 0171)."""
        ...

    def round_completed(self) -> None: ...

    def tool_called(self, tool: str, outcome: str, seconds: float) -> None: ...

    def model_called(
        self,
        purpose: str,
        outcome: str,
        seconds: float,
        usage: Usage | None,
        first_delta_s: float | None = None,
    ) -> None: ...

    def compacted(self) -> None: ...


class NullObserver:
    """A ``TurnObserver`` that records nothing."""

    def turn_started(self) -> None:
        pass

    def turn_ended(
        self,
        reason: TurnEndReason,
        error_reason: str,
        rounds: int = 0,
        seconds: float | None = None,
    ) -> None:
        pass

    def first_delta(self, seconds: float) -> None:
        pass

    def compaction_failed(self, reason: str) -> None:
        pass

    def tools_not_seen(self) -> None:
        pass

    def early_model_call(self, outcome: str) -> None:
        pass

    def context_estimated(self, purpose: str, estimated: int, reported: int) -> None:
        pass

    def round_completed(self) -> None:
        pass

    def tool_called(self, tool: str, outcome: str, seconds: float) -> None:
        pass

    def model_called(
        self,
        purpose: str,
        outcome: str,
        seconds: float,
        usage: Usage | None,
        first_delta_s: float | None = None,
    ) -> None:
        pass

    def compacted(self) -> None:
        pass


@dataclass(frozen=True)
class TurnDependencies:
    """What every turn of a replica shares: the ports, the tools, the settings, and who
    this replica is (``replica_id`` owns the leases)."""

    store: SessionStore
    gateway: ModelGateway
    backends: ToolBackends
    hub: Hub
    clock: Clock
    settings: TurnSettings
    replica_id: str
    tools: ToolRunner
    declarations: Sequence[ToolDeclaration]
    observer: TurnObserver = field(default_factory=NullObserver)
    #: Spans of turns, rounds, model calls and tool calls; off by default.
    tracer: Tracer = NULL_TRACER
    #: The process's one project cache, shared with the session access checks; None:
    #: the turns keep their own (``prompt_cache_s``, ``dependency_timeout_s``).
    projects: ProjectDirectory | None = None
    #: The models whose dropped tools were logged already: once each (decision 0297).
    warned_endpoints: set[str] = field(default_factory=set)
    #: The model's input tokens per estimated token, learned from its reported usage
    #: (decision 0350).
    calibration: TokenCalibration = field(default_factory=TokenCalibration)
