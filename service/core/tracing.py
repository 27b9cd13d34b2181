"""The core's tracing port: spans of turns, rounds, model calls, tool calls and store
units of work, without OpenTelemetry (docs/contributing.md; decision 0190).

``Tracer`` is what the turn loop and the store see; ``service.adapters.tracing`` puts it
on OpenTelemetry, and ``NULL_TRACER`` (the default everywhere) does nothing, so a planner
that traces nothing pays an attribute lookup and an empty ``with`` per span.

What a span may carry (docs/spec/storage.md; decision 0190): names from the fixed set below, a
tool's name only when it is one of the twelve, counts, reasons (stable UPPER_SNAKE
codes, never messages), the configured model, and of the ids only the session's and the
turn's (and the planner's own tool-call ids). Never text of any kind: no human or
assistant text, tool arguments or results, summaries or tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

#: A span attribute's value (OpenTelemetry's primitive types and their sequences).
AttributeValue = str | bool | int | float | Sequence[str] | Sequence[int]
Attributes = Mapping[str, AttributeValue]

# Span names: a fixed set, whatever the data (names are indexed; content never is).
TURN_SPAN = "planner.turn"
#: A model answer with tool calls and the running of its calls (docs/spec/turn-loop.md step 6), with
#: the compaction check before it.
ROUND_SPAN = "planner.round"
#: The turn's last model call when it made no round: the answer, a failure or a stop.
ANSWER_SPAN = "planner.answer"
#: ``chat <model>`` and ``execute_tool <tool>``: OpenTelemetry's GenAI conventions.
MODEL_CALL_SPAN = "chat"
TOOL_CALL_SPAN = "execute_tool"
#: ``store.<operation>``: one unit of work of the store (``adapters/store/work.py``).
STORE_SPAN = "store"

# Attributes.
SESSION_ID = "ballet.planner.session_id"
TURN_ID = "ballet.planner.turn_id"
END_REASON = "ballet.planner.turn.end_reason"
ERROR_REASON = "ballet.planner.error_reason"
ROUNDS = "ballet.planner.turn.rounds"
ROUND = "ballet.planner.round"
TOOL_CALLS = "ballet.planner.tool_calls"
PURPOSE = "ballet.planner.purpose"
OUTCOME = "ballet.planner.outcome"
STORE_OPERATION = "ballet.planner.store.operation"
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_MODEL = "gen_ai.request.model"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
GEN_AI_TOOL_TYPE = "gen_ai.tool.type"


@dataclass(frozen=True)
class SpanRef:
    """A span to link to later, as the tracer knows it (opaque to the core)."""

    handle: object


class Span(Protocol):
    """An open span."""

    def set_attributes(self, attributes: Attributes) -> None:
        """Add or replace attributes (see the module docstring for what may go here)."""
        ...

    def rename(self, name: str) -> None:
        """Rename the span, when what it was is known only at its end (a round or the
        turn's answer); ``name`` is one of the names above."""
        ...

    def fail(self, reason: str) -> None:
        """Mark the operation failed: ``reason`` is a stable UPPER_SNAKE reason, never a
        message."""
        ...


class Tracer(Protocol):
    """Opens spans (``service.adapters.tracing.OtelTracer``; ``NULL_TRACER``)."""

    def span(
        self,
        name: str,
        attributes: Attributes | None = None,
        *,
        links: Sequence[SpanRef] = (),
    ) -> AbstractContextManager[Span]:
        """A span, current inside the ``with`` (so spans opened there, in this task and
        in tasks created there, are its children), child of the span current where it
        opens; linked to ``links``. An exception leaving the ``with`` marks it failed
        with the exception's type (never its message)."""
        ...

    def current(self) -> SpanRef | None:
        """The span current here, to link to; None when there is none (or tracing is
        off)."""
        ...


class _NullSpan:
    """A span that records nothing, and its own context manager."""

    def set_attributes(self, attributes: Attributes) -> None:
        pass

    def rename(self, name: str) -> None:
        pass

    def fail(self, reason: str) -> None:
        pass

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None


NULL_SPAN = _NullSpan()


class NullTracer:
    """A ``Tracer`` that records nothing: tracing off."""

    def span(
        self,
        name: str,
        attributes: Attributes | None = None,
        *,
        links: Sequence[SpanRef] = (),
    ) -> AbstractContextManager[Span]:
        return NULL_SPAN

    def current(self) -> SpanRef | None:
        return None


NULL_TRACER = NullTracer()
