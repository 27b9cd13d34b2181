"""A turn's first model call, started while its start commits (decision 0380), and the
call after a round, started while the round's last results commit (decision 0391).

Before a turn's first delta the planner makes two waits that depend on nothing of each
other: the start's durable commit (the human's message, ``message_accepted`` and the turn
row; docs/spec/api-and-streams.md: an acknowledged message is stored) and the model's
first output. Everything the first request is made of is in memory when the message
arrives: the session's context as this process's store keeps it, the prompt as the
turn's ``PromptSource`` keeps it, and the message itself. So, once the start's statement
is on its way (the turn service builds the request after it, decision 0394),
``EarlyCall.start`` builds that request the way the turn loop will, and opens the model
stream at once, concurrently with the commit (the gateway client sends a request when
its stream is opened, decision 0396); it reads no more than the stream's first chunk,
and nothing of it reaches a client or a tool until the loop takes it over.

The loop runs only once the start is durable, and takes the call over only when the
request it builds itself is the very same (``EarlyCall.take``: every field but the
request id and the deadlines); otherwise, when the start is refused (a duplicate, a
queued message, a limit), when its commit fails, or when the turn ends before its first
model call, the early call is cancelled (``EarlyCall.cancel``). The only cost of a
cancelled call is the model's work up to the cancellation, metered to the project: a
message that failed to store, or was not a new turn, can be charged a few input tokens.

The call after a round (``EarlyCall.after_round``) is the same idea one step later: the
loop builds the request its next step would make from what the round's last commit
stores, opens it (its request sent) just before it hands that commit to the store, and
takes it over, through the same ``take``, only once the commit is durable; a commit
that fails cancels it.

No early call is made when any of its parts is not in memory (a context the store would
read, a prompt the directory would read), when the turn could not start with a model
call (a summary to build the system-side context from, an estimate over the compaction
threshold, a turn of the session running here), or when the message is traced (the
gateway call stays the child of the loop's model-call span, decision 0190).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from service.core.context import with_context
from service.core.conversation import Conversations
from service.core.estimate import messages_tokens
from service.core.model import ContextEstimate, Message, Session, Turn, copied
from service.core.ports import Acting, ModelChunk, ModelRequest, Purpose
from service.core.turn.compact import Compactor
from service.core.turn.events import EventBuilder
from service.core.turn.model_call import model_request, output_cap
from service.core.turn.prompt import Prompt, PromptSource
from service.core.turn.settings import TurnDependencies, TurnObserver
from service.core.turn.state import TurnHandle, TurnRun

log = logging.getLogger(__name__)

#: Cancelled early calls being closed.
_CLOSING: set[asyncio.Task[None]] = set()


def turn_request(
    deps: TurnDependencies,
    conversations: Conversations,
    state: TurnRun,
    prompt: Prompt,
    *,
    estimate: int,
    cap: int,
) -> ModelRequest:
    """The turn-purpose request the loop makes next for ``state`` with ``prompt``, its
    input estimated at ``estimate`` tokens and its output capped at ``cap``
    (``output_cap``). One function for the loop and the early call, so that both build
    the same request from the same state."""
    return model_request(
        deps,
        state,
        purpose=Purpose.TURN,
        credential_ref=prompt.credential_ref,
        system=prompt.system,
        system_context=with_context(prompt.context, state.context_block),
        messages=conversations.model_messages(state.session.session_id, state.messages),
        tools=deps.declarations,
        max_output_tokens=cap,
        input_estimate=estimate,
    )


class EarlyCall:
    """A model stream opened before what it follows was durable: the turn's start, or a
    round's last results; see the module docstring. Made by ``start`` (owned by the turn
    service until the turn is launched, then by the turn's loop) or by ``after_round``
    (owned by the loop)."""

    def __init__(
        self,
        request: ModelRequest,
        stream: AsyncIterator[ModelChunk],
        started: float,
        observer: TurnObserver | None = None,
    ):
        #: The request the stream was opened with.
        self.request = request
        #: The clock's ``monotonic()`` when the stream was opened (seconds).
        self.started = started
        self._stream = stream
        self._first: asyncio.Task[ModelChunk | None] = asyncio.get_running_loop().create_task(
            _first_chunk(stream), name="early model call"
        )
        self._consumed = False
        self._closing: asyncio.Task[None] | None = None
        self._observer = observer
        self._counted = False

    @classmethod
    def start(
        cls,
        deps: TurnDependencies,
        prompts: PromptSource,
        conversations: Conversations,
        *,
        turn: Turn,
        session: Session,
        acting: Acting,
        message: Message,
    ) -> EarlyCall | None:
        """Open the first model stream of ``turn`` (not stored yet) for ``message`` in
        ``session``, or None when a part of its request is not in memory or the turn
        might not start with a model call (module docstring). Never raises and never
        waits: a failure to build the request (a bug) is logged and gives None."""
        try:
            handle = TurnHandle(turn, session, acting, 0)
            request = _request(deps, prompts, conversations, handle, message)
        except Exception as error:  # an optimisation: never a reason for a send to fail
            log.error("the early model call's request failed: %s", type(error).__name__)
            log.debug("the early model call's failure", exc_info=error)
            return None
        if request is None:
            return None
        return cls.opened(deps, request)

    @classmethod
    def after_round(
        cls,
        deps: TurnDependencies,
        conversations: Conversations,
        state: TurnRun,
        prompt: Prompt,
        *,
        messages: list[Message],
        context: ContextEstimate,
    ) -> EarlyCall | None:
        """The turn's next model call, opened while its round's last results commit
        (decision 0391): the request ``state`` would make with ``prompt`` once its
        messages are ``messages`` and its estimate ``context`` (what the commit stores),
        or None when it is traced or that step might not be a model call (a compaction
        due, a budget spent). The loop has checked its other ends (``_gate``). Never
        raises and never waits, as ``start``."""
        if deps.tracer.current() is not None:
            return None  # the gateway call stays the child of its model call's span (0190)
        try:
            ahead = copied(state, messages=messages, context=context)
            request = _next_request(deps, conversations, ahead, prompt)
            return None if request is None else cls.opened(deps, request)
        except Exception as error:  # an optimisation: never a reason for a turn to fail
            log.error("the next model call's request failed: %s", type(error).__name__)
            log.debug("the next model call's failure", exc_info=error)
            return None

    @classmethod
    def opened(cls, deps: TurnDependencies, request: ModelRequest) -> EarlyCall:
        """The call of ``request``, its stream opened now."""
        return cls(request, deps.gateway.stream(request), deps.clock.monotonic(), deps.observer)

    def take(self, request: ModelRequest) -> EarlyCall | None:
        """This call, taken over by the loop, when ``request`` is the request it was
        opened with (every field but ``request_id`` and ``deadlines``); else None, and
        the call is cancelled."""
        same = copied(request, request_id=self.request.request_id, deadlines=self.request.deadlines)
        if same != self.request:
            self._count("differed")
            self.cancel()
            return None
        self._count("taken")
        return self

    async def chunks(self) -> AsyncIterator[ModelChunk]:
        """The stream's chunks, the first one included; raises what the stream raised.
        Closing this iterator (the turn stopped) cancels the call; once it is started,
        ``cancel`` leaves the call to it."""
        if self._closing is not None:
            return
        self._consumed = True
        try:
            first = await self._first
            if first is None:
                return
            yield first
            async for chunk in self._stream:
                yield chunk
        finally:
            if not self._first.done():
                self._first.cancel()
            await _close(self._stream)

    def cancel(self) -> None:
        """Cancel the call (the commit it follows was refused or failed, the turn
        stopped, or the loop did not take it); its chunks go nowhere. Idempotent; returns
        at once."""
        if self._consumed or self._closing is not None:
            return
        self._count("cancelled")
        self._first.cancel()
        self._closing = asyncio.get_running_loop().create_task(
            self._close_after_first(), name="early model call cancelled"
        )
        # Held until done: the event loop keeps only weak references to tasks.
        _CLOSING.add(self._closing)
        self._closing.add_done_callback(_CLOSING.discard)

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel`` was called (tests)."""
        return self._closing is not None

    async def closed(self) -> None:
        """Wait until a cancelled call is closed (tests)."""
        if self._closing is not None:
            await asyncio.wait({self._closing})

    def _count(self, outcome: str) -> None:
        if self._observer is not None and not self._counted:
            self._counted = True
            self._observer.early_model_call(outcome)

    async def _close_after_first(self) -> None:
        await asyncio.wait({self._first})
        if not self._first.cancelled():
            # Read, so that a failure nobody waits for is not reported as lost.
            self._first.exception()
        await _close(self._stream)


def _request(
    deps: TurnDependencies,
    prompts: PromptSource,
    conversations: Conversations,
    handle: TurnHandle,
    message: Message,
) -> ModelRequest | None:
    """The first request of ``handle``'s turn for ``message``, built from what is in
    memory; None when it cannot be (``EarlyCall.start``)."""
    if deps.tracer.current() is not None:
        # Traced: the gateway call stays the child of its model call's span (0190),
        # which the loop opens.
        return None
    turn, acting = handle.turn, handle.acting
    snapshot = deps.store.kept_context(handle.session_id)
    if snapshot is None or snapshot.session.summary or snapshot.session.running_turn_id:
        return None
    prompt = prompts.kept(acting, snapshot.session.project_id)
    if prompt is None:
        return None
    kept = snapshot.session
    state = TurnRun(
        handle=handle,
        events=EventBuilder(kept.session_id, turn.turn_id, turn.human_id, deps.clock),
        session=kept,
        summary_up_to=kept.summary_up_to,
        messages=[*snapshot.messages, message],
        # What the start's commit adds to the kept context (the store's cache does
        # the same): the message's tokens as pending.
        context=ContextEstimate(
            kept.context.base_tokens,
            kept.context.pending_tokens + messages_tokens([message]),
        ),
    )
    return _next_request(deps, conversations, state, prompt)


def _next_request(
    deps: TurnDependencies, conversations: Conversations, state: TurnRun, prompt: Prompt
) -> ModelRequest | None:
    """The turn request ``state`` makes next, or None when a compaction may come first
    or a budget ends the turn before it. ``state`` is a copy: the estimate marks it."""
    estimate = Compactor(deps, state, _never_commits).request_tokens(prompt)
    if estimate > deps.settings.compact_at_tokens:
        return None
    cap = output_cap(deps, state, Purpose.TURN, estimate)
    if not isinstance(cap, int):
        return None
    return turn_request(deps, conversations, state, prompt, estimate=estimate, cap=cap)


async def _first_chunk(stream: AsyncIterator[ModelChunk]) -> ModelChunk | None:
    return await anext(stream, None)


async def _close(stream: AsyncIterator[ModelChunk]) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception as error:
            log.debug("closing an early model call failed", exc_info=error)


async def _never_commits(*_: object) -> None:
    raise AssertionError("an early call's state never compacts")
