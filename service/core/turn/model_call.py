"""One model call of a turn: the request (docs/spec/turn-loop.md step 4) and its streamed answer.

Text deltas are relayed to the session's streams as they arrive (turn-purpose calls
only), under the id the stored answer will have. Every tool call of the answer gets the
planner's own id as soon as it appears (its start, or the complete call), unique in the
session: the provider's id is kept beside it, only to speak to the provider again.
Stopping the turn stops the stream at once.

What the model writes into a call's name and id is kept short (decision 0223): a name
longer than any tool's is cut (it names no tool, and its call gets ``UNKNOWN_TOOL``), and
a provider id longer than ``MAX_PROVIDER_ID_CHARS`` is dropped (the call is then spoken
of to the provider by the planner's id).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, assert_never

from service.core import tracing
from service.core.errors import ModelFailure
from service.core.estimate import declarations_tokens, text_tokens
from service.core.ids import new_call_id, new_message_id, new_model_request_id
from service.core.model import TextDelta, ToolCallProgress
from service.core.ports.model import (
    FinishChunk,
    ModelDeadlines,
    ModelMessage,
    ModelRequest,
    Purpose,
    TextChunk,
    ToolCallChunk,
    ToolCallStartChunk,
    ToolDeclaration,
)
from service.core.turn import ending as endings
from service.core.turn.ending import Ending
from service.core.turn.settings import TurnDependencies
from service.core.turn.state import Answer, PendingCall, TurnRun

if TYPE_CHECKING:
    from service.core.turn.early import EarlyCall

log = logging.getLogger(__name__)

#: The longest tool name kept from the model (the tools' names are far shorter).
MAX_TOOL_NAME_CHARS = 200
#: The longest provider call id kept (providers use ten to a few dozen characters).
MAX_PROVIDER_ID_CHARS = 256


@dataclass(frozen=True)
class Streamed:
    """A streamed answer and how its stream ended: normally (``failure`` None and not
    ``stopped``), with a ``ModelFailure``, or stopped because the turn must end."""

    answer: Answer
    failure: ModelFailure | None = None
    stopped: bool = False


def time_left(deps: TurnDependencies, state: TurnRun) -> float:
    """Seconds left of ``planner.turn_timeout`` (negative once it has run out)."""
    elapsed = (deps.clock.now() - state.handle.turn.start_time).total_seconds()
    return deps.settings.turn_timeout_s - elapsed


#: The smallest output cap a model call is made with: a call whose turn has fewer tokens
#: of its budget left is not made (decision 0291).
MIN_OUTPUT_TOKENS = 16


def output_cap(
    deps: TurnDependencies, state: TurnRun, purpose: Purpose, input_tokens: int
) -> int | Ending:
    """The output cap of the next model call of ``purpose`` whose request is estimated at
    ``input_tokens``, or the ending that stops the turn before it (decision 0291).

    The cap is the smallest of the configured cap (``max_output_tokens``, or
    ``compaction_max_output_tokens``), what the model's window has left after the request
    (never below ``MIN_OUTPUT_TOKENS``: the estimate may be high), and what
    ``turn_max_tokens`` has left after the request. The turn's budgets are checked first:
    ``turn_max_model_requests`` made, or fewer than ``MIN_OUTPUT_TOKENS`` of the token
    budget left after the request, end it ``BUDGET_EXHAUSTED``.
    """
    settings = deps.settings
    if state.model_requests >= settings.turn_max_model_requests:
        return endings.budget_exhausted(
            "model_requests",
            f"the turn made {state.model_requests} model calls, its budget "
            "(planner.turn_max_model_requests)",
        )
    budget_left = settings.turn_max_tokens - state.tokens_spent - input_tokens
    if budget_left < MIN_OUTPUT_TOKENS:
        return endings.budget_exhausted(
            "tokens",
            f"the next model call (about {input_tokens} input tokens) would not fit what is "
            f"left of the turn's {settings.turn_max_tokens} tokens (planner.turn_max_tokens; "
            f"{state.tokens_spent} spent)",
        )
    configured = (
        settings.compaction_max_output_tokens
        if purpose is Purpose.COMPACTION
        else settings.max_output_tokens
    )
    window_left = max(MIN_OUTPUT_TOKENS, settings.model_context_tokens - input_tokens)
    return min(configured, window_left, budget_left)


def model_request(
    deps: TurnDependencies,
    state: TurnRun,
    *,
    purpose: Purpose,
    credential_ref: str,
    system: str,
    messages: Sequence[ModelMessage],
    tools: Sequence[ToolDeclaration],
    system_context: str = "",
    max_output_tokens: int = 0,
    input_estimate: int = 0,
) -> ModelRequest:
    """A request metered to the session's project with its model credential reference;
    each model deadline is capped by what is left of the turn (docs/spec/turn-loop.md,
    Deadlines). ``system`` goes before the tools, ``system_context`` after them
    (``ModelRequest``). ``max_output_tokens`` is the answer's cap (``output_cap``)."""
    settings = deps.settings
    left = max(0.1, time_left(deps, state))
    return ModelRequest(
        project_id=state.session.project_id,
        credential_ref=credential_ref,
        model=settings.model,
        purpose=purpose,
        system_prompt=system,
        system_context=system_context,
        messages=messages,
        tools=tools,
        request_id=new_model_request_id(),
        max_output_tokens=max_output_tokens,
        input_estimate=input_estimate,
        deadlines=ModelDeadlines(
            first_delta_s=min(settings.model_first_delta_s, left),
            idle_s=min(settings.model_idle_s, left),
            total_s=min(settings.model_total_s, left),
        ),
    )


async def stream_answer(
    deps: TurnDependencies,
    state: TurnRun,
    request: ModelRequest,
    *,
    relay: bool,
    early: EarlyCall | None = None,
) -> Streamed:
    """Stream one answer through the gateway; ``relay`` sends its text deltas to the
    session's streams. Turn-purpose usage is added to the turn's. Never raises but
    ``CancelledError``.

    Traced as ``chat <model>`` (OpenTelemetry's GenAI conventions): purpose, outcome,
    finish reason, usage and the number of tool calls; the gateway call, retries
    included, is its child (decision 0190)."""
    attributes = {
        tracing.GEN_AI_OPERATION: tracing.MODEL_CALL_SPAN,
        tracing.GEN_AI_MODEL: request.model,
        tracing.PURPOSE: request.purpose.value,
    }
    name = f"{tracing.MODEL_CALL_SPAN} {request.model}"
    with deps.tracer.span(name, attributes) as span:
        streamed = await _stream_answer(deps, state, request, relay=relay, early=early)
        answer = streamed.answer
        outcome = "stopped" if streamed.stopped else "ok"
        if streamed.failure is not None:
            outcome = streamed.failure.reason
            span.fail(streamed.failure.reason)
        traced: dict[str, tracing.AttributeValue] = {
            tracing.OUTCOME: outcome,
            tracing.TOOL_CALLS: len(answer.calls),
        }
        if answer.finish is not None:
            traced[tracing.GEN_AI_FINISH_REASONS] = [answer.finish.value]
        if answer.usage is not None:
            traced[tracing.GEN_AI_INPUT_TOKENS] = answer.usage.input_tokens
            traced[tracing.GEN_AI_OUTPUT_TOKENS] = answer.usage.output_tokens
        span.set_attributes(traced)
        return streamed


async def _stream_answer(
    deps: TurnDependencies,
    state: TurnRun,
    request: ModelRequest,
    *,
    relay: bool,
    early: EarlyCall | None,
) -> Streamed:
    handle = state.handle
    answer = Answer(message_id=new_message_id())
    if handle.stopping:
        if early is not None:
            early.cancel()
        return Streamed(answer, stopped=True)
    # An early call (decision 0380) was opened before the turn was stored: its time
    # counts from then.
    started = deps.clock.monotonic() if early is None else early.started
    first_output: list[float] = []
    state.model_requests += 1
    chunks = deps.gateway.stream(request) if early is None else early.chunks()

    async def consume() -> None:
        async for chunk in chunks:
            if not first_output:
                first_output.append(deps.clock.monotonic() - started)
            if isinstance(chunk, TextChunk):
                offset = answer.add_text(chunk.text)
                if relay and chunk.text:
                    _first_delta(deps, state)
                    deps.hub.publish_delta(
                        TextDelta(
                            handle.session_id,
                            handle.turn_id,
                            answer.message_id,
                            offset,
                            chunk.text,
                        )
                    )
            elif isinstance(chunk, ToolCallStartChunk):
                call = _call_at(answer, chunk.index, chunk.name)
                if relay:
                    _first_delta(deps, state)
                    deps.hub.publish_progress(
                        ToolCallProgress(
                            handle.session_id,
                            handle.turn_id,
                            call.call_id,
                            call.name,
                            chunk.index,
                        )
                    )
            elif isinstance(chunk, ToolCallChunk):
                call = _call_at(answer, chunk.index, chunk.call.name, completing=True)
                call.name = _short_name(chunk.call.name)
                provider_id = chunk.call.call_id
                call.provider_call_id = (
                    provider_id if len(provider_id) <= MAX_PROVIDER_ID_CHARS else ""
                )
                call.arguments = chunk.call.arguments
                call.problem = chunk.problem
                call.cut = chunk.cut
                call.complete = True
            elif isinstance(chunk, FinishChunk):
                answer.finish = chunk.reason
                answer.usage = chunk.usage
                answer.model = chunk.model
            else:
                assert_never(chunk)

    task = asyncio.get_running_loop().create_task(consume())
    # A stop cancels the stream at once; the turn's own task is never cancelled.
    forget = handle.on_stop(task.cancel)
    try:
        await asyncio.wait({task})
    finally:
        forget()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
        if early is not None:
            # Closed by its iterator once started; a stream cancelled before it started
            # is closed here.
            early.cancel()
    stopped = task.cancelled()
    failure: ModelFailure | None = None
    outcome = "stopped" if stopped else "ok"
    if not stopped:
        error = task.exception()
        if isinstance(error, ModelFailure):
            failure = error
        elif error is not None:
            # A bug, not the model's doing; the traceback may quote content, so it is
            # kept to DEBUG (docs/spec/operations.md).
            log.error(
                "the model stream failed unexpectedly: %s",
                type(error).__name__,
                extra=handle.log_fields(),
            )
            log.debug("the model stream's failure", exc_info=error, extra=handle.log_fields())
            failure = ModelFailure("MODEL_ERROR", f"the model call failed: {type(error).__name__}")
        if failure is not None:
            outcome = failure.reason
    deps.observer.model_called(
        request.purpose.value,
        outcome,
        deps.clock.monotonic() - started,
        answer.usage,
        first_output[0] if first_output else None,
    )
    if request.purpose is Purpose.TURN and answer.usage is not None:
        state.usage = state.usage + answer.usage
        _check_tools_seen(deps, state, request, answer)
    state.tokens_spent += _spent(request, answer)
    return Streamed(answer, failure, stopped)


def _first_delta(deps: TurnDependencies, state: TurnRun) -> None:
    """Report the turn's time to first delta, from its start (its message accepted) to
    the first delta its streams are sent; once per turn."""
    if not state.delta_sent:
        state.delta_sent = True
        elapsed = (deps.clock.now() - state.handle.turn.start_time).total_seconds()
        deps.observer.first_delta(max(0.0, elapsed))


def _call_at(answer: Answer, index: int, name: str, *, completing: bool = False) -> PendingCall:
    """The call at ``index`` of the answer, given the planner's id when it first appears.

    A second complete call at an index already completed (a gateway that numbers badly)
    is a new call, never merged into the first.
    """
    call = answer.calls.get(index)
    if call is not None and not (completing and call.complete):
        return call
    if call is not None:
        index = max(answer.calls) + 1
    call = PendingCall(call_id=new_call_id(), name=_short_name(name))
    answer.calls[index] = call
    return call


def _short_name(name: str) -> str:
    return name if len(name) <= MAX_TOOL_NAME_CHARS else name[:MAX_TOOL_NAME_CHARS]


def _spent(request: ModelRequest, answer: Answer) -> int:
    """The tokens a call spent of its turn's budget: as reported, else the request's
    estimate (the caller's, ``request.input_estimate``) plus the answer's estimated text
    and arguments (decision 0291)."""
    usage = answer.usage
    if usage is not None and usage.total > 0:
        return usage.total
    output = text_tokens(answer.text) + sum(
        text_tokens(call.arguments) for call in answer.calls.values()
    )
    return request.input_estimate + output


#: An answer whose reported input is below this share of the tool declarations' own
#: estimate cannot have been prompted with them (decision 0297).
TOOLS_SEEN_SHARE = 0.5


@functools.lru_cache(maxsize=8)
def _declared_tokens(tools: tuple[ToolDeclaration, ...]) -> int:
    return declarations_tokens(tools)


def _check_tools_seen(
    deps: TurnDependencies, state: TurnRun, request: ModelRequest, answer: Answer
) -> None:
    """Count, and log once per model (the endpoint the gateway routes it to), an answer
    whose reported input tokens are far below what the request's tool declarations alone
    take: the server dropped them (llama.cpp with a chat template that has no tool block
    does so silently)."""
    usage = answer.usage
    if not request.tools or usage is None or usage.input_tokens <= 0:
        return
    declared = _declared_tokens(tuple(request.tools))
    if usage.input_tokens >= declared * TOOLS_SEEN_SHARE:
        return
    deps.observer.tools_not_seen()
    endpoint = f"{request.model} ({answer.model})" if answer.model else request.model
    if endpoint in deps.warned_endpoints:
        return
    deps.warned_endpoints.add(endpoint)
    log.warning(
        "the model %s reported %d input tokens for a request whose tool declarations alone "
        "take about %d: the model server likely dropped the tools, so the model cannot call "
        "them (llama.cpp: start llama-server with --jinja and a tool-capable chat template; "
        "vLLM: --enable-auto-tool-choice and a --tool-call-parser; Ollama: a model with tool "
        "support; docs/operations.md)",
        endpoint,
        usage.input_tokens,
        declared,
        extra=state.handle.log_fields(),
    )
