"""Running the tool calls of one round (docs/spec/turn-loop.md step 5; cancel and interruption).

The calls of one answer run concurrently, at most ``tool_concurrency`` at a time; each
result is stored (with its ``tool_call_finished`` event) as its call completes, so the
stored order is completion order. When the turn is asked to stop, read calls and calls
not yet started are abandoned at once, and started writes get ``cancel_grace`` seconds:
a write that finishes in time has its real result stored, the rest get the ending's
synthetic result ("cancelled; the outcome is unknown").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from service.core import tracing
from service.core.estimate import messages_tokens
from service.core.model import ContextEstimate, SessionEvent, copied
from service.core.ports import ToolCall, TurnPatch
from service.core.tools import TOOLS_BY_NAME, WRITE_TOOLS, ToolContext, ToolOutcome, error_result
from service.core.turn.model_call import time_left
from service.core.turn.settings import TurnDependencies
from service.core.turn.state import PendingCall, TurnRun

log = logging.getLogger(__name__)

#: Stores events (with a turn patch and a context estimate) in one commit, the last flag
#: true for the round's last results (every call has one, and no stop was asked); raises
#: the loop's ``Abandon``.
Commit = Callable[
    [list[SessionEvent], TurnPatch | None, ContextEstimate | None, bool], Awaitable[object]
]


@dataclass(frozen=True)
class RoundCommit:
    """A round's answer and calls not yet stored, with the turn patch and the context
    estimate of their commit (decision 0114: stored with the round's first result)."""

    events: list[SessionEvent]
    patch: TurnPatch
    context: ContextEstimate | None


_Result = tuple[ToolOutcome, float]


def _tool_span(call: PendingCall) -> tuple[str, tracing.Attributes]:
    """``execute_tool <tool>`` (OpenTelemetry's GenAI conventions) and its attributes;
    a name the model made up is ``unknown``, never itself (it is the model's text)."""
    tool = call.name if call.name in TOOLS_BY_NAME else "unknown"
    attributes = {
        tracing.GEN_AI_OPERATION: tracing.TOOL_CALL_SPAN,
        tracing.GEN_AI_TOOL_NAME: tool,
        tracing.GEN_AI_TOOL_TYPE: "function",
        tracing.GEN_AI_TOOL_CALL_ID: call.call_id,
    }
    return f"{tracing.TOOL_CALL_SPAN} {tool}", attributes


class ToolRound:
    """The calls of one answer, run and stored; ``run`` returns when every call has a
    stored result or the turn is stopping (the ending gives the rest theirs)."""

    def __init__(self, deps: TurnDependencies, state: TurnRun, commit: Commit) -> None:
        self._deps = deps
        self._state = state
        self._commit = commit
        self._started: set[str] = set()
        self._unstored: RoundCommit | None = None
        self._shared: Mapping[str, Sequence[PendingCall]] = {}

    async def run(
        self,
        calls: Sequence[PendingCall],
        unstored: RoundCommit | None = None,
        shared: Mapping[str, Sequence[PendingCall]] | None = None,
    ) -> RoundCommit | None:
        """Run ``calls``, storing ``unstored`` (the round itself) with the first results;
        returns it when the turn stopped before any call returned (then the ending stores
        it). ``shared`` maps a call's id to the reads that repeat it exactly: each gets
        that call's result, stored with it, and is not run (decision 0292). Raises what
        ``commit`` raises, after stopping every call still running (so no write lands
        after the turn was closed)."""
        self._unstored = unstored
        self._shared = shared or {}
        self._started = set()
        if not calls:
            return self._unstored
        semaphore = asyncio.Semaphore(self._deps.settings.tool_concurrency)
        context = ToolContext(
            acting=self._state.handle.acting,
            project_id=self._state.session.project_id,
            reserve_write=self._reserve_write,
            # Tool deadlines are capped by what is left of planner.turn_timeout
            # (docs/spec/turn-loop.md).
            timeout_s=max(0.0, time_left(self._deps, self._state)),
        )

        async def one(call: PendingCall) -> _Result:
            async with semaphore:
                self._started.add(call.call_id)
                with self._deps.tracer.span(*_tool_span(call)) as span:
                    begin = self._deps.clock.monotonic()
                    outcome = await self._deps.tools.run(
                        ToolCall(call.call_id, call.name, call.arguments), context
                    )
                    span.set_attributes({tracing.OUTCOME: outcome.error_reason or "ok"})
                    if outcome.error_reason:
                        span.fail(outcome.error_reason)
                return outcome, self._deps.clock.monotonic() - begin

        loop = asyncio.get_running_loop()
        pending = {loop.create_task(one(call)): call for call in calls}
        try:
            await self._collect(pending)
        finally:
            left = [task for task in pending if not task.done()]
            for task in left:
                task.cancel()
            if left:
                await asyncio.wait(left)
        return self._unstored

    def unstored_events(self) -> list[SessionEvent]:
        """The events of the round not stored yet (its answer and calls), if any."""
        return [] if self._unstored is None else list(self._unstored.events)

    def _reserve_write(self) -> bool:
        state = self._state
        if state.writes >= self._deps.settings.max_writes_per_turn:
            return False
        state.writes += 1
        return True

    async def _collect(self, pending: dict[asyncio.Task[_Result], PendingCall]) -> None:
        """Store results as calls complete; on a stop, abandon reads and give started
        writes ``cancel_grace`` seconds. ``pending`` loses the calls stored."""
        stopper: asyncio.Future[_Result] = asyncio.get_running_loop().create_future()

        def stop() -> None:
            if not stopper.done():
                stopper.set_result((error_result("STOPPED", ""), 0.0))

        forget = self._state.handle.on_stop(stop)
        try:
            while pending:
                done, _ = await asyncio.wait(
                    {*pending, stopper}, return_when=asyncio.FIRST_COMPLETED
                )
                finished = [task for task in pending if task in done]
                if finished:
                    stored = [(pending.pop(task), task) for task in finished]
                    await self._store(stored, last=not pending and stopper not in done)
                if stopper in done:
                    break
        finally:
            forget()
            stopper.cancel()
        writes = {
            task
            for task, call in pending.items()
            if call.call_id in self._started and call.name in WRITE_TOOLS
        }
        for task in pending:
            if task not in writes:
                task.cancel()
        if not writes:
            return
        await asyncio.wait(writes, timeout=self._deps.settings.cancel_grace_s)
        finished = [
            task for task in writes if task.done() and not task.cancelled() and not task.exception()
        ]
        if finished:
            await self._store([(pending.pop(task), task) for task in finished])

    async def _store(
        self, finished: Sequence[tuple[PendingCall, asyncio.Task[_Result]]], *, last: bool = False
    ) -> None:
        state = self._state
        events: list[SessionEvent] = []
        for call, task in finished:
            error = task.exception()
            if error is not None:
                # ToolRunner.run never raises but CancelledError: this is a bug.
                log.error(
                    "the tool runner raised %s",
                    type(error).__name__,
                    extra=state.handle.log_fields(),
                )
                outcome, seconds = error_result("INTERNAL", "the tool failed unexpectedly"), 0.0
            else:
                outcome, seconds = task.result()
            self._deps.observer.tool_called(
                call.name if call.name in TOOLS_BY_NAME else "unknown",
                outcome.error_reason or "ok",
                seconds,
            )
            if outcome.error_reason == "CREDENTIAL_EXPIRED":
                state.credential_expired = True
            events.extend(state.events.tool_result(call.call_id, call.name, outcome))
            for repeat in self._shared.get(call.call_id, ()):
                events.extend(state.events.tool_result(repeat.call_id, repeat.name, outcome))
        patch = TurnPatch(writes=state.writes)
        context: ContextEstimate | None = None
        first = self._unstored
        if first is not None:
            # The round's own commit: its answer and calls, then these results.
            patch = copied(first.patch, writes=state.writes)
            if first.context is not None:
                added = messages_tokens(e.message for e in events if e.message is not None)
                context = copied(first.context, pending_tokens=first.context.pending_tokens + added)
            events = [*first.events, *events]
        await self._commit(events, patch, context, last)
        if first is not None:
            self._unstored = None
            self._deps.observer.round_completed()
