"""One turn's step machine (docs/spec/turn-loop.md).

``TurnLoop.run`` drives a turn from its start to its stored end, one step at a time.
Each step returns the next:

    Prepare ──> Compact ──> CallModel ──> RunTools(calls) ──> Compact ──> ...
                                │
                                └──> End(ending, pending)

- ``Prepare`` loads what the model sees (the summary and the messages after it) and
  builds the system prompt; if the project or skill cannot be read, the turn ends
  ``FAILED``/``DEPENDENCY_UNAVAILABLE`` before any model call.
- ``Compact`` compacts when the context estimate is over the threshold (docs/spec/compaction.md).
- ``CallModel`` streams one answer. Without tool calls it ends the turn (``COMPLETED``);
  with calls it stores the answer and its calls in one commit (a round) and runs them.
- ``RunTools`` runs the round's calls and stores each result. A round whose calls all
  read stores the answer and its calls with the first result, in one commit (decision
  0114): nothing of it can matter outside the planner until a call has returned.
- ``End`` is stored by the one ending (``ending.closing_commit``).

``_gate`` is the one place that checks stop requests (cancel, shutdown, a lost lease, the
turn timeout), an expired credential (at the end of a round) and ``max_rounds`` (no
model call after round ``max_rounds``), before every step. Stopping is a signal on the
``TurnHandle``, not a task cancellation: the model stream stops at once, read tools are
abandoned, started writes get ``cancel_grace``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import TypeVar, assert_never

from service.core import tracing
from service.core.conversation import Conversations
from service.core.errors import PlannerError, StoreConflict, StoreUnavailable
from service.core.estimate import messages_tokens
from service.core.model import (
    ContextEstimate,
    EventKind,
    Message,
    SessionEvent,
    TurnEndReason,
    copied,
)
from service.core.ports import FinishReason, Purpose, SummaryUpdate, TurnCommit, TurnPatch
from service.core.tools import WRITE_TOOLS, ToolOutcome, error_result
from service.core.tools.cut import cut_text, utf8_size
from service.core.tracing import NULL_SPAN, Span, SpanRef
from service.core.turn import ending as endings
from service.core.turn.compact import Compactor
from service.core.turn.early import EarlyCall, turn_request
from service.core.turn.ending import Ending, OnPromoted, close_stored_turn, closing_commit
from service.core.turn.events import EventBuilder
from service.core.turn.model_call import output_cap, stream_answer
from service.core.turn.prompt import Prompt, PromptSource
from service.core.turn.settings import TurnDependencies
from service.core.turn.state import Answer, PendingCall, TurnHandle, TurnRun
from service.core.turn.telling import StoreThenTell
from service.core.turn.tool_round import RoundCommit, ToolRound

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Finish reasons after which the answer is a cut one (docs/spec/turn-loop.md: they reach the client
#: as a cut answer with its reason); calls in such an answer may be partial and never run.
_CUT_FINISHES = frozenset({FinishReason.LENGTH, FinishReason.CONTENT_FILTER})


@dataclass(frozen=True)
class Prepare:
    """Load the context and build the system prompt."""


@dataclass(frozen=True)
class Compact:
    """Compact the context if it is over the threshold, then call the model."""


@dataclass(frozen=True)
class CallModel:
    """Stream one answer."""


@dataclass(frozen=True)
class RunTools:
    """Run the calls of the round; ``unstored`` is the round's answer and calls when
    they are to be stored with the first result (a round of reads)."""

    calls: tuple[PendingCall, ...]
    unstored: RoundCommit | None = None
    #: Reads that repeat a call of ``calls`` exactly, by that call's id: they share its
    #: result (decision 0292).
    shared: Mapping[str, tuple[PendingCall, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class End:
    """End the turn with ``ending``, storing ``pending`` events (the final or cut answer)
    in the same commit."""

    ending: Ending
    pending: tuple[SessionEvent, ...] = field(default=())


Step = Prepare | Compact | CallModel | RunTools | End


class Abandon(Exception):
    """The run cannot store its state any more: the database is gone (the cause is
    ``StoreUnavailable``: the turn is closed ``FAILED`` once it answers again), or the
    turn is no longer this run's (``StoreConflict``: another replica closed it, or the
    session was deleted)."""


class TurnLoop:
    """Drives one turn (``handle``) to its stored end. ``on_step`` sees every step taken
    (tests read the sequence; nothing else depends on it)."""

    def __init__(
        self,
        deps: TurnDependencies,
        prompts: PromptSource,
        handle: TurnHandle,
        *,
        conversations: Conversations | None = None,
        on_step: Callable[[Step], None] | None = None,
        on_promoted: OnPromoted | None = None,
    ) -> None:
        self._deps = deps
        self._on_promoted = on_promoted
        self._prompts = prompts
        # Not ``or``: an empty Conversations is still the service's, to be filled.
        self._conversations = (
            conversations if conversations is not None else Conversations(max_sessions=1)
        )
        self._handle = handle
        self._on_step = on_step
        self._state = TurnRun(
            handle=handle,
            events=EventBuilder(
                handle.session_id, handle.turn_id, handle.turn.human_id, deps.clock
            ),
            session=handle.session,
        )
        self._prompt: Prompt | None = None
        self._span: Span = NULL_SPAN
        self._round: Span = NULL_SPAN
        self._started_by: tuple[SpanRef, ...] = ()
        self._compactor = Compactor(deps, self._state, self._commit_compaction)
        self._tools = ToolRound(deps, self._state, self._commit_results)
        self._told = StoreThenTell.of(deps)

    async def run(self) -> None:
        """Drive the turn to its end and store it; never raises but ``CancelledError``.

        Traced as one span, a child of the span current where the turn was launched (the
        ``Chat`` or ``SendMessage`` RPC that sent its message) and linked to it, since a
        turn outlives that RPC (decision 0190)."""
        tracer, handle = self._deps.tracer, self._handle
        started_by = tracer.current()
        self._started_by = () if started_by is None else (started_by,)
        attributes = {tracing.SESSION_ID: handle.session_id, tracing.TURN_ID: handle.turn_id}
        with tracer.span(tracing.TURN_SPAN, attributes, links=self._started_by) as span:
            self._span = span
            await self._run()

    async def _run(self) -> None:
        handle = self._handle
        timer = asyncio.get_running_loop().call_later(
            self._deps.settings.turn_timeout_s, handle.request_stop, endings.TURN_TIMEOUT
        )
        try:
            end = await self._drive()
            try:
                await self._finish(end)
            except Abandon as reason:
                if not isinstance(reason.__cause__, StoreUnavailable):
                    raise
                log.warning(
                    "the database failed at the turn's end; it is stored once it answers",
                    extra=handle.log_fields(),
                )
                await self._finish_when_the_database_answers(end)
        except Abandon as reason:
            # No model call opened ahead stays open while the turn is closed (0380, 0391).
            handle.drop_early()
            if isinstance(reason.__cause__, StoreUnavailable):
                log.warning(
                    "the database failed mid-turn; the turn ends FAILED once it answers",
                    extra=handle.log_fields(),
                )
                await self._close_when_the_database_answers()
            else:
                log.warning("turn abandoned: %s", reason, extra=handle.log_fields())
        except Exception as error:
            handle.drop_early()
            log.error(
                "turn failed unexpectedly: %s", type(error).__name__, extra=handle.log_fields()
            )
            log.debug("the turn's failure", exc_info=error, extra=handle.log_fields())
            with contextlib.suppress(Exception):
                await self._finish(End(endings.failed("INTERNAL", "internal error")))
        finally:
            timer.cancel()
            # A model call opened ahead and never taken (decision 0391) goes too.
            handle.drop_early()
            self._deps.hub.clear_answer(handle.session_id)

    # ------------------------------------------------------------------ the machine

    async def _drive(self) -> End:
        step: Step = Prepare()
        # One span per model call of the turn and what follows it: a round, or the answer
        # that ends the turn (named when known); from the compaction check to the next.
        with contextlib.ExitStack() as rounds:
            while True:
                step = self._gate(step)
                if self._on_step is not None:
                    self._on_step(step)
                if isinstance(step, End):
                    # Ended before a model call opened ahead was taken (0380, 0391).
                    self._handle.drop_early()
                    return step
                if isinstance(step, Prepare):
                    step = await self._prepare()
                elif isinstance(step, Compact):
                    rounds.close()
                    self._round = rounds.enter_context(self._round_span())
                    assert self._prompt is not None
                    if self._handle.join_pending:
                        # The joined message changes the request: a call opened ahead
                        # (decision 0391) would differ.
                        self._handle.drop_early()
                        await self._join()
                    await self._compactor.maybe_compact(self._prompt)
                    step = CallModel()
                elif isinstance(step, CallModel):
                    step = await self._call_model()
                    self._name_round(step)
                elif isinstance(step, RunTools):
                    step = await self._run_tools(step)
                else:
                    assert_never(step)

    def _round_span(self) -> AbstractContextManager[Span]:
        """The span of the next model call and what follows it, linked to the RPC that
        started the turn (decision 0190)."""
        return self._deps.tracer.span(tracing.ROUND_SPAN, links=self._started_by)

    def _name_round(self, step: RunTools | End) -> None:
        if isinstance(step, RunTools):
            # The calls run (refused ones, beyond the per-answer cap, are not counted).
            calls = {tracing.ROUND: self._state.rounds, tracing.TOOL_CALLS: len(step.calls)}
            self._round.set_attributes(calls)
        else:
            # No round (docs/spec/turn-loop.md step 6): the answer, or a call that failed or
            # stopped.
            self._round.rename(tracing.ANSWER_SPAN)

    def _gate(self, step: Step) -> Step:
        """The one check before every step: a stop request, then at the end of a round an
        expired credential and ``max_rounds``."""
        if isinstance(step, End):
            return step
        if self._handle.stop is not None:
            return End(self._handle.stop)
        if isinstance(step, Compact) and self._state.rounds:
            if self._state.credential_expired:
                return End(endings.CREDENTIAL_EXPIRED)
            if self._state.cut_answers >= 2:
                return End(endings.CUT_TWICE)
            if self._state.rounds >= self._deps.settings.max_rounds:
                return End(endings.MAX_ROUNDS)
            if self._state.tool_budget_refused:
                return End(
                    endings.budget_exhausted(
                        "tool_calls",
                        f"the turn ran {self._state.tool_calls} tool calls, its budget "
                        "(planner.turn_max_tool_calls)",
                    )
                )
        return step

    # ------------------------------------------------------------------ the steps

    async def _prepare(self) -> Compact | End:
        state = self._state
        snapshot = await self._guard(self._deps.store.load_context(state.session.session_id))
        if snapshot is None:
            raise Abandon("the session was deleted")
        state.session = snapshot.session
        state.summary = snapshot.session.summary
        state.summary_up_to = snapshot.session.summary_up_to
        state.messages = list(snapshot.messages)
        state.context = snapshot.session.context
        try:
            self._prompt = await self._prompts.prompt(self._handle.acting, state.session.project_id)
        except PlannerError as error:
            log.warning(
                "system prompt unavailable: %s", error.reason, extra=self._handle.log_fields()
            )
            return End(endings.failed("DEPENDENCY_UNAVAILABLE", error.message))
        state.versions = self._prompt.versions
        return Compact()

    async def _call_model(self) -> RunTools | End:
        state, prompt = self._state, self._prompt
        assert prompt is not None
        estimate = self._compactor.request_tokens(prompt)
        cap = output_cap(self._deps, state, Purpose.TURN, estimate)
        if isinstance(cap, Ending):
            return End(cap)
        request = turn_request(
            self._deps, self._conversations, state, prompt, estimate=estimate, cap=cap
        )
        early, self._handle.early = self._handle.early, None
        if early is not None:
            # Opened while the start or the round's results committed (decisions 0380,
            # 0391): used only when it is this very request, else cancelled.
            early = early.take(request)
            if early is not None:
                request = early.request
        streamed = await stream_answer(self._deps, state, request, relay=True, early=early)
        answer = streamed.answer
        self._compactor.answered(answer.usage)
        if streamed.stopped:
            return End(self._handle.stop or endings.CANCELLED, self._cut(answer, ""))
        if streamed.failure is not None:
            failure = streamed.failure
            finish = "truncated" if failure.reason == "MODEL_STREAM_TRUNCATED" else ""
            return End(endings.failed(failure.reason, failure.message), self._cut(answer, finish))
        if answer.finish is FinishReason.CONTENT_FILTER and answer.calls:
            # The filter may have cut a call's arguments, or removed calls: none is run.
            return End(
                endings.failed(
                    "MODEL_STREAM_TRUNCATED",
                    f"the model's answer was cut ({answer.finish.value}) inside a tool call",
                ),
                self._cut(answer, answer.finish.value),
            )
        if answer.finish is FinishReason.LENGTH and answer.calls:
            # Stopped at the output limit after or inside calls (decision 0292): the
            # complete ones run, a cut one gets an error result, and the round counts. A
            # call that started but never came whole is the one the limit cut.
            for call in answer.calls.values():
                if not call.complete:
                    call.cut = call.complete = True
            state.cut_answers += 1
        calls = answer.complete_calls()
        if not calls:
            cut = answer.finish in _CUT_FINISHES
            finish = answer.finish.value if answer.finish is not None and cut else ""
            if answer.finish is FinishReason.REFUSAL:
                finish = FinishReason.REFUSAL.value
            event = state.events.assistant_message(
                answer.message_id,
                answer.text,
                usage=answer.usage,
                cut=cut,
                finish_reason=finish,
                served_model=answer.model,
            )
            if answer.finish is FinishReason.LENGTH:
                # A runaway answer stopped at its cap: shown cut, and the turn says why
                # (decision 0291).
                return End(endings.OUTPUT_LIMIT, (event,))
            return End(endings.COMPLETED, (event,))
        return await self._store_round(answer, calls)

    async def _join(self) -> None:
        """Take the queued JOIN messages into this turn before its next model request,
        after the round's results (decision 0303): stored now as human messages of this
        turn, each queued turn ending ``JOINED``; raises ``Abandon``."""
        self._handle.join_pending = False
        deps, handle = self._deps, self._handle
        stored = await self._guard(
            deps.store.join_queued(
                handle.session_id, handle.turn_id, deps.replica_id, deps.clock.now()
            )
        )
        self._told.tell(stored, handle.turn)
        mine = [e for e in stored if e.turn_id == handle.turn_id]
        self._remember(TurnCommit(handle.session_id, handle.turn_id, deps.clock.now()), mine)

    async def _run_tools(self, step: RunTools) -> Compact | End:
        unstored = await self._tools.run(step.calls, step.unstored, step.shared)
        if unstored is not None:
            # Stopped before any call returned: the ending stores the round.
            return End(self._handle.stop or endings.CANCELLED, tuple(unstored.events))
        return Compact()

    async def _store_round(self, answer: Answer, calls: list[PendingCall]) -> RunTools:
        """The round of ``answer``: its text and calls, committed now when a call
        writes (or none is to run), else with the first result (decision 0114). Calls
        that are not run get their error result in the same commit: those beyond
        ``max_tool_calls_per_answer``, those the gateway sent malformed, and those whose
        arguments are over ``tool_arguments_max_bytes`` (stored cut; decision 0221)."""
        state, settings = self._state, self._deps.settings
        events: list[SessionEvent] = []
        if answer.length:
            events.append(
                state.events.assistant_message(
                    answer.message_id, answer.text, usage=answer.usage, served_model=answer.model
                )
            )
        limit = settings.max_tool_calls_per_answer
        allowed: list[PendingCall] = []
        refusals: list[tuple[PendingCall, ToolOutcome]] = []
        repeats: dict[str, list[PendingCall]] = {}
        firsts: dict[tuple[str, str], PendingCall] = {}
        at_limit = answer.finish is FinishReason.LENGTH
        # Only an answer of several calls can repeat one (decision 0292).
        several = len(calls) > 1
        for position, call in enumerate(calls):
            arguments, refusal = call.arguments, None
            oversize = utf8_size(arguments, settings.tool_arguments_max_bytes)
            cut = call.cut or (at_limit and not call.problem and not _json_object(arguments))
            if cut:
                # Kept as valid JSON: the next request carries it back to the model, and
                # servers parse the arguments of earlier calls (decision 0292).
                arguments = cut_text(arguments, settings.tool_arguments_cut_bytes)
            elif oversize is not None:
                arguments = cut_text(arguments, settings.tool_arguments_cut_bytes, oversize)
            key = _call_key(call) if several and not (cut or call.problem) else None
            first = None if key is None else firsts.get(key)
            if cut:
                refusal = error_result(
                    "CUT_AT_OUTPUT_LIMIT",
                    "this call was cut at the output limit: its arguments are incomplete and "
                    "it was not run. Call it again, alone or with shorter arguments.",
                )
            elif first is not None and call.name in WRITE_TOOLS:
                refusal = error_result(
                    "REPEATED_CALL",
                    f"this call repeats call {first.call_id} of the same answer (same tool, "
                    "same arguments); it was not run again",
                )
            elif position >= limit:
                refusal = error_result(
                    "TOO_MANY_CALLS", f"at most {limit} tool calls per answer; this one was not run"
                )
            elif state.tool_calls + len(allowed) >= settings.turn_max_tool_calls:
                refusal = error_result(
                    "TURN_BUDGET_TOOL_CALLS",
                    f"the turn ran its {settings.turn_max_tool_calls} tool calls "
                    "(planner.turn_max_tool_calls); this one was not run",
                )
                state.tool_budget_refused = True
            elif call.problem:
                refusal = error_result("MALFORMED_TOOL_CALL", f"{call.problem}; it was not run")
            elif oversize is not None:
                refusal = error_result(
                    "ARGUMENTS_TOO_LARGE",
                    f"the arguments were {oversize} bytes, more than the "
                    f"{settings.tool_arguments_max_bytes} a tool call may have; the call was "
                    "not run and its arguments are kept cut. Call again with smaller "
                    "arguments, or split the work into several calls.",
                )
            events.append(
                state.events.tool_call(
                    call.call_id,
                    call.name,
                    arguments,
                    provider_call_id=call.provider_call_id,
                    cut=cut or oversize is not None,
                )
            )
            if refusal is not None:
                refusals.append((call, refusal))
            elif first is not None:
                # A repeated read is not run again: it shares the first call's result.
                repeats.setdefault(first.call_id, []).append(call)
            else:
                allowed.append(call)
                if key is not None:
                    firsts.setdefault(key, call)
        for call, outcome in refusals:
            events.extend(state.events.tool_result(call.call_id, call.name, outcome))
        state.rounds += 1
        state.tool_calls += len(allowed)
        # The answer's usage covers everything up to and including it (docs/spec/compaction.md).
        context = (
            ContextEstimate(base_tokens=answer.usage.total, pending_tokens=0)
            if answer.usage is not None
            else None
        )
        patch = copied(state.versions, rounds=state.rounds, usage=state.usage)
        shared = {first: tuple(calls) for first, calls in repeats.items()}
        if allowed and not any(call.name in WRITE_TOOLS for call in allowed):
            return RunTools(tuple(allowed), RoundCommit(events, patch, context), shared)
        await self._commit(events, patch=patch, context=context)
        self._deps.observer.round_completed()
        return RunTools(tuple(allowed), shared=shared)

    def _cut(self, answer: Answer, finish: str) -> tuple[SessionEvent, ...]:
        """The partial answer as streamed, marked cut, when there is text to keep."""
        if not answer.length:
            return ()
        event = self._state.events.assistant_message(
            answer.message_id,
            answer.text,
            usage=answer.usage,
            cut=True,
            finish_reason=finish,
            served_model=answer.model,
        )
        return (event,)

    # ------------------------------------------------------------------ the end

    async def _finish(self, end: End, commit: TurnCommit | None = None) -> None:
        commit = commit or self._ending_commit(end)
        # The ending starts the session's next queued turn in its own transaction
        # (decision 0300); it is told after this turn's end and launched here.
        end_of_turn = await self._guard(
            self._told.end(commit, self._handle.turn, endings.promotion(self._deps))
        )
        self._remember(commit, end_of_turn.events)
        promoted = end_of_turn.promoted
        if promoted is not None and self._on_promoted is not None:
            self._on_promoted(promoted, self._state.session)
        self._trace_end(end.ending)

    async def _finish_when_the_database_answers(self, end: End) -> None:
        """Store ``end`` (the answer as streamed, the way the turn ended) once the
        database answers again, retried with backoff: fenced by ownership (the commit's
        ``owner``), not by the lease's clock (decision 0311). The human saw the answer, so
        it is kept when no other replica ended the turn meanwhile; when one did (its
        sweeper, after the lease expired), the commit is refused (``StoreConflict``) and
        nothing more is stored, as before. A commit that landed though its answer was
        lost is refused the same way: the turn is no longer running."""
        commit = self._ending_commit(end)
        delay = 0.05
        while True:
            try:
                await self._finish(end, replace(commit, now=self._deps.clock.now()))
                return
            except Abandon as reason:
                if not isinstance(reason.__cause__, StoreUnavailable):
                    log.warning(
                        "the turn's end was refused: %s", reason, extra=self._handle.log_fields()
                    )
                    return
            # Jitter keeps a replica's closing turns from hitting the database in lockstep.
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(1.0, delay * 2)

    def _ending_commit(self, end: End) -> TurnCommit:
        state = self._state
        final = end.pending[0].message if end.pending else None
        context: ContextEstimate | None = None
        if final is not None and final.usage is not None and not final.cut:
            context = ContextEstimate(base_tokens=final.usage.total, pending_tokens=0)
        commit = closing_commit(
            state.events,
            end.ending,
            state.totals,
            state.messages,
            pending=end.pending,
            patch=state.versions,
            context=context,
            owner=self._deps.replica_id,
        )
        return commit

    async def _close_when_the_database_answers(self) -> None:
        """Close the turn of a run whose commit failed because the database is
        unavailable: ``FAILED``/``DATABASE_UNAVAILABLE``, from what is stored (the failed
        commit may have landed before the connection broke), retried with backoff until
        the database answers; conditional on this replica still owning the turn, so a
        sweeper that closed it first wins (decision 0070)."""
        state, deps = self._state, self._deps
        turn = replace(
            self._handle.turn,
            rounds=state.rounds,
            usage=state.usage,
            compaction_usage=state.compaction_usage,
            writes=state.writes,
        )
        delay = 0.05
        while True:
            with contextlib.suppress(StoreUnavailable):
                await close_stored_turn(
                    deps.store,
                    deps.hub,
                    deps.clock,
                    deps.observer,
                    turn,
                    endings.DATABASE_UNAVAILABLE,
                    owner=deps.replica_id,
                    pending=self._tools.unstored_events(),
                    promote=endings.promotion(deps),
                    on_promoted=self._on_promoted,
                )
                self._trace_end(endings.DATABASE_UNAVAILABLE)
                return
            # Jitter keeps a replica's closing turns from hitting the database in lockstep.
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(1.0, delay * 2)

    def _trace_end(self, ending: Ending) -> None:
        self._span.set_attributes(
            {tracing.END_REASON: ending.reason.value, tracing.ROUNDS: self._state.rounds}
        )
        if ending.error_reason:
            self._span.set_attributes({tracing.ERROR_REASON: ending.error_reason})
        if ending.reason is TurnEndReason.FAILED:
            self._span.fail(ending.error_reason or "FAILED")

    # ------------------------------------------------------------------ storage

    async def _commit_results(
        self,
        events: list[SessionEvent],
        patch: TurnPatch | None,
        context: ContextEstimate | None,
        last: bool,
    ) -> None:
        if last:
            # The round's last results: the next model call opens while they commit, and
            # is taken over only once they are durable (decision 0391). An optimisation:
            # never a reason for the results not to be stored.
            try:
                self._open_next_call(events, context)
            except Exception as error:
                self._handle.drop_early()
                log.error("opening the next model call failed: %s", type(error).__name__)
                log.debug("the next model call's failure", exc_info=error)
        try:
            await self._commit(events, patch=patch, context=context)
        except BaseException:
            self._handle.drop_early()
            raise

    def _open_next_call(self, events: list[SessionEvent], context: ContextEstimate | None) -> None:
        """Open the model call that follows a round whose last results ``events`` (with
        the commit's estimate ``context``) are being stored, when nothing but their commit
        stands before it: no stop, no end of a round's budget (``_gate``), no message
        joining the turn. The next ``CallModel`` takes it over if its request is the
        same, else cancels it (``EarlyCall``)."""
        handle, prompt = self._handle, self._prompt
        if prompt is None or handle.early is not None or handle.join_pending:
            return
        if isinstance(self._gate(Compact()), End):
            return
        added, context = _after_commit(self._state, events, context)
        handle.early = EarlyCall.after_round(
            self._deps,
            self._conversations,
            self._state,
            prompt,
            messages=[*self._state.messages, *added],
            context=context,
        )

    async def _commit_compaction(
        self,
        events: list[SessionEvent],
        patch: TurnPatch,
        summary: SummaryUpdate | None,
        context: ContextEstimate | None,
    ) -> None:
        await self._commit(events, patch=patch, summary=summary, context=context)

    async def _commit(
        self,
        events: list[SessionEvent],
        *,
        patch: TurnPatch | None = None,
        summary: SummaryUpdate | None = None,
        context: ContextEstimate | None = None,
    ) -> None:
        await self._store(
            TurnCommit(
                session_id=self._handle.session_id,
                turn_id=self._handle.turn_id,
                now=self._deps.clock.now(),
                events=events,
                turn_patch=patch,
                summary=summary,
                context=context,
                owner=self._deps.replica_id,
            )
        )

    async def _store(self, commit: TurnCommit) -> None:
        """Apply ``commit`` and tell what it stored (``StoreThenTell``), then remember it;
        raises ``Abandon``."""
        self._remember(commit, await self._guard(self._told.commit(commit, self._handle.turn)))

    def _remember(self, commit: TurnCommit, stored: list[SessionEvent]) -> None:
        """Keep what ``commit`` stored (``stored``, already told) in the turn's state."""
        state = self._state
        added, state.context = _after_commit(state, stored, commit.context)
        state.messages.extend(added)

    async def _guard(self, operation: Awaitable[T]) -> T:
        try:
            return await operation
        except (StoreUnavailable, StoreConflict) as error:
            raise Abandon(type(error).__name__) from error


def _after_commit(
    state: TurnRun, events: list[SessionEvent], context: ContextEstimate | None
) -> tuple[list[Message], ContextEstimate]:
    """What the turn's messages gain and its context estimate once ``events`` are stored
    with the commit's estimate ``context``: the messages they carry (a compaction's marker
    is not one the model sees), and without an estimate of the commit's own, their tokens
    added to the pending ones."""
    messages = [
        e.message for e in events if e.message is not None and e.kind is not EventKind.COMPACTED
    ]
    if context is not None:
        # The store holds this estimate; so must the turn, or the next compaction check
        # ignores the usage an answer just reported (docs/spec/compaction.md).
        return messages, context
    added = messages_tokens(e.message for e in events if e.message is not None)
    return messages, ContextEstimate(
        state.context.base_tokens, state.context.pending_tokens + added
    )


def _json_object(arguments: str) -> bool:
    """Whether ``arguments`` is a complete JSON object (a call the output limit did not
    cut; decision 0292)."""
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def _call_key(call: PendingCall) -> tuple[str, str]:
    """What makes two calls of one answer the same call: the tool and its arguments,
    compared as JSON values when they parse (key order and spacing aside)."""
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return call.name, call.arguments
    return call.name, json.dumps(value, sort_keys=True, separators=(",", ":"))
