"""One turn's step machine (seed: Planner, Instructions, Authority, Tools, Limits;
SPEC section 5; decision 0010).

``TurnRunner.run`` drives a ``Run`` (the mutable state of one turn) through its steps:
load the context; build the system prompt (instructions, project and organization, the
planner skill in the version the project resolves); before each model call, compact
when the estimate is over the threshold (SPEC 6); stream one answer through the gateway,
relaying text deltas; store an answer with tool calls in one commit, run the calls
concurrently (at most ``tool_concurrency`` at a time) and store each result as it
completes; end the turn when the model answers without tools (COMPLETED) or after round
``max_rounds`` (MAX_ROUNDS).

Stopping (cancel, interruption, turn timeout) is a signal, ``Run.request_stop``, not a
task cancellation: the model stream stops at once, read tools are abandoned, started
write tools get ``cancel_grace`` seconds, then one commit stores the partial answer
(marked cut), a synthetic result for every call without one, and ``turn_ended``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

from service.core import prompts
from service.core.compaction import (
    chunk_blocks,
    compaction_prompt,
    estimate_tokens,
    looks_like_failure,
    plan_compaction,
    render_transcript,
    tokens_for_bytes,
)
from service.core.context import build_system_prompt, to_model_messages
from service.core.errors import (
    ModelFailure,
    PlannerError,
    StoreConflict,
    StoreUnavailable,
)
from service.core.fanout import Hub
from service.core.ids import new_id
from service.core.model import (
    ChangesetProposedData,
    CompactedData,
    ContextEstimate,
    EventKind,
    KnowledgeWrittenData,
    Message,
    MessageKind,
    Session,
    SessionEvent,
    TextDelta,
    Turn,
    TurnEndedData,
    TurnEndReason,
    Usage,
)
from service.core.ports import (
    Acting,
    Clock,
    ContextSnapshot,
    FinishChunk,
    ModelDeadlines,
    ModelGateway,
    ModelMessage,
    ModelRequest,
    ProjectInfo,
    Purpose,
    Role,
    RunningLimits,
    SessionStore,
    SkillDocument,
    SummaryUpdate,
    TextChunk,
    ToolBackends,
    ToolCall,
    ToolCallChunk,
    ToolDeclaration,
    TurnCommit,
    TurnPatch,
)
from service.core.recovery import close_turn, is_write_tool, synthetic_outcome
from service.core.tools import (
    TOOL_SCHEMA_VERSION,
    TOOLS_BY_NAME,
    ToolContext,
    ToolOutcome,
    ToolRunner,
    error_result,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class TurnSettings:
    """The limits a turn runs under (seed: [planner]; SPEC sections 5, 7, 8).

    Times are seconds. ``max_rounds`` >= 1 is checked by the settings loader.
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
    tool_concurrency: int = 4
    tool_call_timeout_s: float = 30.0
    dependency_timeout_s: float = 10.0
    model_first_delta_s: float = 60.0
    model_idle_s: float = 60.0
    model_total_s: float = 300.0
    lease_s: float = 15.0
    sweep_interval_s: float = 5.0
    prompt_cache_s: float = 60.0
    message_max_bytes: int = 32 * 1024
    running_limits: RunningLimits = field(default_factory=RunningLimits)


class TurnObserver(Protocol):
    """Metrics hooks; labels never carry session, turn, human or project ids."""

    def turn_started(self) -> None: ...

    def turn_ended(
        self,
        reason: TurnEndReason,
        error_reason: str,
        rounds: int = 0,
        seconds: float | None = None,
    ) -> None: ...

    def compaction_failed(self) -> None: ...

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

    def compaction_failed(self) -> None:
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


@dataclass
class Stop:
    reason: TurnEndReason
    error_reason: str = ""
    message: str = ""


@dataclass
class _Answer:
    message_id: str
    parts: list[str] = field(default_factory=list)
    length: int = 0
    calls: list[ToolCall] = field(default_factory=list)
    usage: Usage | None = None
    failure: ModelFailure | None = None
    stopped: bool = False

    def add(self, text: str) -> int:
        """Append a delta; returns its offset in characters. Pieces are joined once,
        when the text is read, not on every delta."""
        offset = self.length
        self.parts.append(text)
        self.length += len(text)
        return offset

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass
class _Prompt:
    system: str
    project: ProjectInfo
    skill: SkillDocument | None
    fixed_bytes: int


@dataclass
class Run:
    """Mutable state of one running turn; everything immutable lives on the service."""

    turn: Turn
    session: Session
    acting: Acting
    project_id: str
    human_sequence: int
    summary: str = ""
    summary_up_to: int = 0
    messages: list[Message] = field(default_factory=list)
    context: ContextEstimate = field(default_factory=ContextEstimate)
    rounds: int = 0
    usage: Usage = field(default_factory=Usage)
    compaction_usage: Usage = field(default_factory=Usage)
    writes: int = 0
    compaction_failed: bool = False
    credential_expired: bool = False
    stop: Stop | None = None
    stop_event: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    patch_versions: TurnPatch = field(default_factory=TurnPatch)

    def request_stop(self, stop: Stop) -> None:
        if self.stop is None:
            self.stop = stop
        self.stop_event.set()


class Abandon(Exception):
    """The run cannot store its state any more: the database is gone (the cause is
    ``StoreUnavailable``: the run closes the turn ``FAILED`` once it answers again), or
    the turn is no longer this run's to store (``StoreConflict``: another replica closed
    it, or the session was deleted)."""


@dataclass(frozen=True)
class TurnDependencies:
    """What every turn of a replica shares: the ports, the tools, the settings, and
    who this replica is (``replica_id`` owns the leases)."""

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


class TurnRunner:
    """Runs turns to their end; holds what every run shares (the ports, the settings,
    the project and skill cache). ``on_finished`` is called when a run ends, however."""

    def __init__(self, deps: TurnDependencies, on_finished: Callable[[Run], None]) -> None:
        self._store = deps.store
        self._gateway = deps.gateway
        self._backends = deps.backends
        self._hub = deps.hub
        self._clock = deps.clock
        self._settings = deps.settings
        self._replica = deps.replica_id
        self._tools = deps.tools
        self._declarations = tuple(deps.declarations)
        self._declarations_bytes = sum(
            len(d.name) + len(d.description) + len(d.parameters_json_schema)
            for d in self._declarations
        )
        self._observer = deps.observer
        self._on_finished = on_finished
        self._cache: dict[tuple[str, ...], tuple[float, object]] = {}

    async def run(self, run: Run) -> None:
        """Drive ``run`` to its end and store it; never raises but ``CancelledError``."""
        timer = asyncio.get_running_loop().call_later(
            self._settings.turn_timeout_s,
            run.request_stop,
            Stop(TurnEndReason.FAILED, "TURN_TIMEOUT", "the turn ran out of time"),
        )
        try:
            await self._drive(run)
        except Abandon as reason:
            if isinstance(reason.__cause__, StoreUnavailable):
                log.warning(
                    "the database failed mid-turn; the turn ends FAILED once it answers: %s",
                    reason,
                    extra=run_fields(run),
                )
                await self._close_unstorable(run)
            else:
                log.warning("turn abandoned: %s", reason, extra=run_fields(run))
        except Exception:
            log.exception("turn failed unexpectedly", extra=run_fields(run))
            with contextlib.suppress(Exception):
                await self._finish(
                    run, [], Stop(TurnEndReason.FAILED, "INTERNAL", "internal error")
                )
        finally:
            timer.cancel()
            self._hub.clear_answer(run.session.session_id)
            self._on_finished(run)
            run.done.set()

    async def _drive(self, run: Run) -> None:
        snapshot = await self._commit_guard(self._store.load_context(run.session.session_id))
        if snapshot is None:
            raise Abandon("the session was deleted")
        self._load_snapshot(run, snapshot)
        try:
            prompt = await self._prepare(run)
        except PlannerError as error:
            log.warning("system prompt unavailable: %s", error.message, extra=run_fields(run))
            await self._finish(
                run,
                [],
                Stop(TurnEndReason.FAILED, "DEPENDENCY_UNAVAILABLE", error.message),
            )
            return
        while True:
            if run.stop is not None:
                await self._finish(run, [], run.stop)
                return
            await self._maybe_compact(run, prompt)
            answer = await self._call_model(run, prompt)
            if answer.stopped or answer.failure is not None:
                stop = run.stop or Stop(
                    TurnEndReason.FAILED,
                    answer.failure.reason if answer.failure else "MODEL_ERROR",
                    answer.failure.message if answer.failure else "",
                )
                pending = [self._assistant_event(run, answer, cut=True)] if answer.length else []
                await self._finish(run, pending, stop)
                return
            if not answer.calls:
                await self._finish(
                    run,
                    [self._assistant_event(run, answer, cut=False)],
                    Stop(TurnEndReason.COMPLETED),
                )
                return
            await self._round(run, answer)
            if run.stop is not None:
                await self._finish(run, [], run.stop)
                return
            if run.credential_expired:
                await self._finish(
                    run,
                    [],
                    Stop(TurnEndReason.FAILED, "CREDENTIAL_EXPIRED", "the human's token expired"),
                )
                return
            if run.rounds >= self._settings.max_rounds:
                await self._finish(run, [], Stop(TurnEndReason.MAX_ROUNDS))
                return

    def _load_snapshot(self, run: Run, snapshot: ContextSnapshot) -> None:
        run.session = snapshot.session
        run.summary = snapshot.session.summary
        run.summary_up_to = snapshot.session.summary_up_to
        run.messages = list(snapshot.messages)
        run.context = snapshot.session.context

    # ------------------------------------------------------------------ step 2

    async def _prepare(self, run: Run) -> _Prompt:
        timeout = self._settings.dependency_timeout_s
        project = await self._cached(
            ("project", run.acting.human_id, run.project_id),
            lambda: self._backends.get_project(run.acting, run.project_id, timeout),
        )
        assert isinstance(project, ProjectInfo)
        skill: SkillDocument | None = None
        if project.planner_skill:
            found = await self._cached(
                ("skill", run.acting.human_id, run.project_id, project.planner_skill),
                lambda: self._backends.read_skill(
                    run.acting, run.project_id, project.planner_skill, timeout
                ),
            )
            assert isinstance(found, SkillDocument)
            skill = found
        system = build_system_prompt(project, skill)
        run.patch_versions = TurnPatch(
            instructions_version=prompts.INSTRUCTIONS_VERSION,
            tool_schema_version=TOOL_SCHEMA_VERSION,
            skill_name=skill.name if skill else "",
            skill_version=skill.version if skill else "",
            model=self._settings.model,
        )
        return _Prompt(
            system=system,
            project=project,
            skill=skill,
            fixed_bytes=len(system.encode()) + self._declarations_bytes,
        )

    async def _cached(self, key: tuple[str, ...], load: object) -> object:
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        assert callable(load)
        value = await load()
        self._cache[key] = (now + self._settings.prompt_cache_s, value)
        if len(self._cache) > 10_000:
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
        return value

    # ------------------------------------------------------------------ step 3

    async def _maybe_compact(self, run: Run, prompt: _Prompt) -> None:
        if run.compaction_failed:
            return
        fixed = prompt.fixed_bytes + len(run.summary.encode())
        estimated = estimate_tokens(run.context, fixed_bytes=fixed)
        if estimated <= self._settings.compact_at_tokens:
            return
        plan = plan_compaction(run.messages, human_sequence=run.human_sequence, summary=run.summary)
        if plan is None:
            return
        started = time.monotonic()
        try:
            summary, usage = await self._summarize(run, plan.previous_summary, plan.messages)
        except ModelFailure as failure:
            run.compaction_failed = True
            self._observer.compaction_failed()
            self._observer.model_called(
                "compaction", failure.reason, time.monotonic() - started, None
            )
            log.warning(
                "compaction failed; continuing uncompacted: %s",
                failure.reason,
                extra=run_fields(run),
            )
            return
        if summary is None:
            return
        if looks_like_failure(summary):
            run.compaction_failed = True
            self._observer.compaction_failed()
            log.warning(
                "compaction returned an empty or error summary; continuing uncompacted",
                extra=run_fields(run),
            )
            return
        now = self._clock.now()
        kept = [m for m in run.messages if m.sequence > plan.up_to]
        base = (
            usage.output_tokens
            if usage is not None and usage.output_tokens
            else tokens_for_bytes(len(summary.encode()))
        )
        context = ContextEstimate(base_tokens=base, pending_bytes=sum(m.size_bytes() for m in kept))
        compaction_usage = run.compaction_usage + (usage or Usage())
        marker = Message(
            session_id=run.session.session_id,
            turn_id=run.turn.turn_id,
            message_id=new_id("msg"),
            kind=MessageKind.COMPACTION,
            create_time=now,
            human_id=run.acting.human_id,
            up_to=plan.up_to,
            estimated_tokens=estimated,
        )
        event = SessionEvent(
            run.session.session_id,
            run.turn.turn_id,
            EventKind.COMPACTED,
            now,
            message=marker,
            data=CompactedData(plan.up_to, estimated),
        )
        stored = await self._commit(
            run,
            [event],
            patch=replace(run.patch_versions, compaction_usage=compaction_usage),
            summary=SummaryUpdate(summary, plan.up_to),
            context=context,
        )
        run.summary = summary
        run.summary_up_to = plan.up_to
        run.messages = kept
        run.context = context
        run.compaction_usage = compaction_usage
        self._observer.compacted()
        log.info(
            "compacted up_to=%d estimated_tokens=%d", plan.up_to, estimated, extra=run_fields(run)
        )
        del stored

    async def _summarize(
        self, run: Run, previous: str, messages: Sequence[Message]
    ) -> tuple[str | None, Usage | None]:
        """Fold ``messages`` into ``previous``, oldest first, in chunks that fit.

        Returns ``(None, None)`` when the turn was asked to stop meanwhile.
        """
        instructions = self._settings.summary_instructions or prompts.summary_instructions()
        summary = previous
        total: Usage | None = None
        chunks = chunk_blocks(
            render_transcript(messages),
            max_tokens=self._settings.compaction_input_max_tokens,
            reserved_tokens=tokens_for_bytes(len(instructions.encode()) + 4 * 1024),
        )
        for chunk in chunks:
            request = self._model_request(
                run,
                Purpose.COMPACTION,
                instructions,
                [ModelMessage(Role.USER, compaction_prompt(summary, chunk))],
                tools=(),
            )
            answer = await self._stream(run, request, relay=False)
            if answer.stopped:
                return None, None
            if answer.failure is not None:
                raise answer.failure
            if looks_like_failure(answer.text):
                return answer.text, answer.usage
            summary = answer.text.strip()
            if answer.usage is not None:
                total = answer.usage if total is None else total + answer.usage
        return summary, total

    # ------------------------------------------------------------------ step 4

    async def _call_model(self, run: Run, prompt: _Prompt) -> _Answer:
        request = self._model_request(
            run,
            Purpose.TURN,
            prompt.system,
            to_model_messages(run.summary, run.messages),
            tools=self._declarations,
        )
        return await self._stream(run, request, relay=True)

    def _model_request(
        self,
        run: Run,
        purpose: Purpose,
        system: str,
        messages: Sequence[ModelMessage],
        *,
        tools: Sequence[ToolDeclaration],
    ) -> ModelRequest:
        left = max(0.1, self._time_left(run))
        return ModelRequest(
            project_id=run.project_id,
            credential_ref=self._credential(run),
            model=self._settings.model,
            purpose=purpose,
            system_prompt=system,
            messages=messages,
            tools=tools,
            request_id=new_id("gen"),
            deadlines=ModelDeadlines(
                first_delta_s=min(self._settings.model_first_delta_s, left),
                idle_s=min(self._settings.model_idle_s, left),
                total_s=min(self._settings.model_total_s, left),
            ),
        )

    def _credential(self, run: Run) -> str:
        hit = self._cache.get(("project", run.acting.human_id, run.project_id))
        if hit is not None and isinstance(hit[1], ProjectInfo):
            return hit[1].model_credential
        return ""

    def _time_left(self, run: Run) -> float:
        elapsed = (self._clock.now() - run.turn.start_time).total_seconds()
        return self._settings.turn_timeout_s - elapsed

    async def _stream(self, run: Run, request: ModelRequest, *, relay: bool) -> _Answer:
        """Stream one answer, stopping at once when the turn is asked to stop."""
        answer = _Answer(message_id=new_id("msg"))
        started = time.monotonic()
        first_delta: list[float] = []

        async def consume() -> None:
            async for chunk in self._gateway.stream(request):
                if not first_delta:
                    first_delta.append(time.monotonic() - started)
                if isinstance(chunk, TextChunk):
                    offset = answer.add(chunk.text)
                    if relay and chunk.text:
                        self._hub.publish_delta(
                            TextDelta(
                                run.session.session_id,
                                run.turn.turn_id,
                                answer.message_id,
                                offset,
                                chunk.text,
                            )
                        )
                elif isinstance(chunk, ToolCallChunk):
                    answer.calls.append(chunk.call)
                elif isinstance(chunk, FinishChunk):
                    answer.usage = chunk.usage

        outcome = "ok"
        if run.stop_event.is_set():
            answer.stopped = True
            return answer
        task = asyncio.get_running_loop().create_task(consume())
        stopper = asyncio.get_running_loop().create_task(run.stop_event.wait())
        try:
            await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
                answer.stopped = True
                outcome = "stopped"
        if not answer.stopped:
            error = task.exception()
            if isinstance(error, ModelFailure):
                answer.failure = error
                outcome = error.reason
            elif error is not None:
                answer.failure = ModelFailure("MODEL_ERROR", f"model call failed: {error!r}")
                outcome = "MODEL_ERROR"
        self._observer.model_called(
            request.purpose.value,
            outcome,
            time.monotonic() - started,
            answer.usage,
            first_delta[0] if first_delta else None,
        )
        if request.purpose is Purpose.TURN and answer.usage is not None:
            run.usage = run.usage + answer.usage
        return answer

    # ------------------------------------------------------------------ step 5

    def _assistant_event(self, run: Run, answer: _Answer, *, cut: bool) -> SessionEvent:
        now = self._clock.now()
        message = Message(
            session_id=run.session.session_id,
            turn_id=run.turn.turn_id,
            message_id=answer.message_id,
            kind=MessageKind.ASSISTANT,
            create_time=now,
            text=answer.text,
            cut=cut,
            human_id=run.acting.human_id,
            usage=answer.usage,
        )
        return SessionEvent(
            run.session.session_id,
            run.turn.turn_id,
            EventKind.ASSISTANT_MESSAGE,
            now,
            message=message,
        )

    async def _round(self, run: Run, answer: _Answer) -> None:
        """Store the answer with its calls, run the calls, store each result."""
        now = self._clock.now()
        events: list[SessionEvent] = []
        if answer.length:
            events.append(self._assistant_event(run, answer, cut=False))
        calls = answer.calls
        seen: set[str] = set()
        for index, call in enumerate(calls):
            if not call.call_id or call.call_id in seen:
                calls[index] = call = ToolCall(new_id("call"), call.name, call.arguments)
            seen.add(call.call_id)
            events.append(
                SessionEvent(
                    run.session.session_id,
                    run.turn.turn_id,
                    EventKind.TOOL_CALL_STARTED,
                    now,
                    message=Message(
                        session_id=run.session.session_id,
                        turn_id=run.turn.turn_id,
                        message_id=new_id("msg"),
                        kind=MessageKind.TOOL_CALL,
                        create_time=now,
                        tool_call_id=call.call_id,
                        tool_name=call.name,
                        tool_arguments=call.arguments,
                        human_id=run.acting.human_id,
                    ),
                )
            )
        limit = self._settings.max_tool_calls_per_answer
        allowed, refused = calls[:limit], calls[limit:]
        for call in refused:
            events.extend(
                self._result_events(
                    run,
                    call,
                    error_result(
                        "TOO_MANY_CALLS",
                        f"at most {limit} tool calls per answer; this one was not run",
                    ),
                )
            )
        run.rounds += 1
        # The answer's usage covers everything up to and including it.
        context = (
            ContextEstimate(base_tokens=answer.usage.total, pending_bytes=0)
            if answer.usage is not None
            else None
        )
        await self._commit(
            run,
            events,
            patch=replace(run.patch_versions, rounds=run.rounds, usage=run.usage),
            context=context,
        )
        self._observer.round_completed()
        await self._run_tools(run, allowed)

    async def _run_tools(self, run: Run, calls: Sequence[ToolCall]) -> None:
        semaphore = asyncio.Semaphore(self._settings.tool_concurrency)
        started: set[str] = set()
        loop = asyncio.get_running_loop()

        def reserve_write() -> bool:
            if run.writes >= self._settings.max_writes_per_turn:
                return False
            run.writes += 1
            return True

        context = ToolContext(
            acting=run.acting,
            project_id=run.project_id,
            reserve_write=reserve_write,
            # Tool deadlines are capped by what is left of planner.turn_timeout (SPEC 5).
            timeout_s=max(0.0, self._time_left(run)),
        )

        async def one(call: ToolCall) -> tuple[ToolOutcome, float]:
            async with semaphore:
                started.add(call.call_id)
                begin = time.monotonic()
                outcome = await self._tools.run(call, context)
                return outcome, time.monotonic() - begin

        pending: dict[asyncio.Task[tuple[ToolOutcome, float]], ToolCall] = {
            loop.create_task(one(call)): call for call in calls
        }
        try:
            await self._await_tools(run, pending, started)
        except Abandon:
            # Nothing more of this run can be stored: stop the calls still running, so no
            # write lands after the turn was closed with "the outcome is unknown".
            left = [task for task in pending if not task.done()]
            for task in left:
                task.cancel()
            if left:
                await asyncio.wait(left)
            raise

    async def _await_tools(
        self,
        run: Run,
        pending: dict[asyncio.Task[tuple[ToolOutcome, float]], ToolCall],
        started: set[str],
    ) -> None:
        """Store each call's result as it completes; on a stop, abandon reads and give
        started writes ``cancel_grace`` seconds. ``pending`` loses the calls stored."""
        stopper = asyncio.get_running_loop().create_task(run.stop_event.wait())
        try:
            while pending:
                done, _ = await asyncio.wait(
                    {*pending, stopper}, return_when=asyncio.FIRST_COMPLETED
                )
                finished = [t for t in pending if t in done]
                if finished:
                    await self._store_results(run, [(pending.pop(t), t) for t in finished])
                if stopper in done:
                    break
        finally:
            stopper.cancel()
        if not pending:
            return
        # Stopping: abandon reads and calls not yet started at once; give started
        # writes cancel_grace seconds (SPEC section 5, Cancel and interruption).
        writes = {
            t: c for t, c in pending.items() if c.call_id in started and is_write_tool(c.name)
        }
        for task in pending:
            if task not in writes:
                task.cancel()
        if writes:
            await asyncio.wait(set(writes), timeout=self._settings.cancel_grace_s)
            finished = [
                t for t in writes if t.done() and not t.cancelled() and t.exception() is None
            ]
            if finished:
                await self._store_results(run, [(pending.pop(t), t) for t in finished])
            for task in writes:
                if not task.done():
                    task.cancel()
        if pending:
            await asyncio.wait(set(pending))

    async def _store_results(
        self,
        run: Run,
        finished: Sequence[tuple[ToolCall, asyncio.Task[tuple[ToolOutcome, float]]]],
    ) -> None:
        events: list[SessionEvent] = []
        for call, task in finished:
            error = task.exception()
            if error is not None:
                log.error("tool runner raised", exc_info=error, extra=run_fields(run))
                outcome = error_result("INTERNAL", "the tool failed unexpectedly")
                seconds = 0.0
            else:
                outcome, seconds = task.result()
            self._observer.tool_called(
                call.name if call.name in TOOLS_BY_NAME else "unknown",
                outcome.error_reason or "ok",
                seconds,
            )
            if outcome.error_reason == "CREDENTIAL_EXPIRED":
                run.credential_expired = True
            events.extend(self._result_events(run, call, outcome))
        await self._commit(run, events, patch=replace(run.patch_versions, writes=run.writes))

    def _result_events(self, run: Run, call: ToolCall, outcome: ToolOutcome) -> list[SessionEvent]:
        now = self._clock.now()
        session_id, turn_id = run.session.session_id, run.turn.turn_id
        events = [
            SessionEvent(
                session_id,
                turn_id,
                EventKind.TOOL_CALL_FINISHED,
                now,
                message=Message(
                    session_id=session_id,
                    turn_id=turn_id,
                    message_id=new_id("msg"),
                    kind=MessageKind.TOOL_RESULT,
                    create_time=now,
                    tool_call_id=call.call_id,
                    tool_name=call.name,
                    tool_result=outcome.content,
                    tool_error=outcome.is_error,
                    human_id=run.acting.human_id,
                ),
            )
        ]
        if outcome.changeset_id:
            events.append(
                SessionEvent(
                    session_id,
                    turn_id,
                    EventKind.CHANGESET_PROPOSED,
                    now,
                    data=ChangesetProposedData(outcome.changeset_id, call.call_id),
                )
            )
        if outcome.knowledge_entry_id:
            events.append(
                SessionEvent(
                    session_id,
                    turn_id,
                    EventKind.KNOWLEDGE_WRITTEN,
                    now,
                    data=KnowledgeWrittenData(
                        outcome.knowledge_entry_id, outcome.knowledge_version, call.call_id
                    ),
                )
            )
        return events

    # ------------------------------------------------------------------ the end

    async def _finish(
        self,
        run: Run,
        pending: list[SessionEvent],
        stop: Stop,
    ) -> None:
        """Store the turn's end with a synthetic result for every call without one."""
        now = self._clock.now()
        events = list(pending)
        events.extend(self._synthetic_results(run, stop.reason))
        events.append(
            SessionEvent(
                run.session.session_id,
                run.turn.turn_id,
                EventKind.TURN_ENDED,
                now,
                data=TurnEndedData(
                    reason=stop.reason,
                    usage=run.usage,
                    compaction_usage=run.compaction_usage,
                    rounds=run.rounds,
                    error_reason=stop.error_reason,
                    error_message=stop.message,
                ),
            )
        )
        context: ContextEstimate | None = None
        final = pending[0].message if pending else None
        if final is not None and final.usage is not None and not final.cut:
            context = ContextEstimate(base_tokens=final.usage.total, pending_bytes=0)
        await self._commit(
            run,
            events,
            patch=replace(
                run.patch_versions,
                rounds=run.rounds,
                usage=run.usage,
                compaction_usage=run.compaction_usage,
                writes=run.writes,
                end_reason=stop.reason,
                error_reason=stop.error_reason,
                error_message=stop.message,
            ),
            context=context,
        )
        self._observer.turn_ended(
            stop.reason,
            stop.error_reason,
            run.rounds,
            (self._clock.now() - run.turn.start_time).total_seconds(),
        )

    def _synthetic_results(self, run: Run, reason: TurnEndReason) -> list[SessionEvent]:
        answered = {m.tool_call_id for m in run.messages if m.kind is MessageKind.TOOL_RESULT}
        events: list[SessionEvent] = []
        for message in run.messages:
            if message.kind is MessageKind.TOOL_CALL and message.tool_call_id not in answered:
                call = ToolCall(message.tool_call_id, message.tool_name, message.tool_arguments)
                events.extend(
                    self._result_events(
                        run, call, synthetic_outcome(reason, is_write_tool(call.name))
                    )
                )
        return events

    # ------------------------------------------------------------------ storage

    async def _commit(
        self,
        run: Run,
        events: list[SessionEvent],
        *,
        patch: TurnPatch | None = None,
        summary: SummaryUpdate | None = None,
        context: ContextEstimate | None = None,
    ) -> list[SessionEvent]:
        commit = TurnCommit(
            session_id=run.session.session_id,
            turn_id=run.turn.turn_id,
            now=self._clock.now(),
            events=events,
            turn_patch=patch,
            summary=summary,
            context=context,
            owner=self._replica,
        )
        stored = await self._commit_guard(self._store.commit(commit))
        for event in stored:
            if event.message is not None and event.kind is not EventKind.COMPACTED:
                run.messages.append(event.message)
        if context is None:
            added = sum(e.message.size_bytes() for e in stored if e.message is not None)
            run.context = replace(run.context, pending_bytes=run.context.pending_bytes + added)
        else:
            # The store now holds this estimate; so must the run, or the next compaction
            # check of this turn ignores the usage an answer just reported (SPEC 6).
            run.context = context
        self._hub.publish(stored)
        return stored

    async def _commit_guard(self, operation: Awaitable[T]) -> T:
        try:
            return await operation
        except (StoreUnavailable, StoreConflict) as error:
            raise Abandon(repr(error)) from error

    async def _close_unstorable(self, run: Run) -> None:
        """Close the turn of a run whose commit failed because the database is
        unavailable: ``FAILED``/``DATABASE_UNAVAILABLE``, with a synthetic result for
        every call without a stored one, retried with backoff until the database answers
        (SPEC 5 and 8; decision 0070).

        The closing commit is built from what is stored, not from the run's memory: the
        failed commit may have landed before the connection broke. It is conditional on
        this replica still owning the turn, so a sweeper that closed it first wins, and it
        stops when the service shuts down (the task is cancelled; the sweeper recovers).
        """
        turn = replace(
            run.turn,
            rounds=run.rounds,
            usage=run.usage,
            compaction_usage=run.compaction_usage,
        )
        delay = 0.05
        while True:
            try:
                await close_turn(
                    self._store,
                    self._hub,
                    self._clock,
                    self._observer,
                    turn,
                    owner=self._replica,
                    reason=TurnEndReason.FAILED,
                    error_reason="DATABASE_UNAVAILABLE",
                    error_message="the database became unavailable during the turn",
                )
                return
            except StoreUnavailable:
                pass
            # Jitter keeps a replica's closing turns from hitting the database in lockstep.
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(1.0, delay * 2)


def run_fields(run: Run) -> dict[str, str]:
    # The context fields of service/logs.py; never content (SPEC section 8).
    return {
        "session": run.session.session_id,
        "turn": run.turn.turn_id,
        "project": run.project_id,
        "actor": run.acting.actor,
    }
