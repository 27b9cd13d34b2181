"""The turn service: what the transport calls to start, cancel and wait for turns
(docs/spec/api-and-streams.md and docs/spec/turn-loop.md).

``send_message`` stores the human message and opens the turn in one transaction, then
runs the turn as a task of its own, so a client that disconnects does not stop it (a
disconnect is not a cancel). The turn's first model call is opened while that
transaction commits, and handed to the turn once it is durable (decision 0380). The
commit and the launch that must follow it run in a task this service owns: a caller
cancelled between the two cannot leave a stored turn that never runs; nor can a commit
whose reply was lost (decision 0372): the turn it may have stored is read back and run.
``cancel`` stops a turn on whichever replica runs it; ``wait_for_end`` serves unary
``SendMessage``; ``stop`` is the graceful shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TypeVar

from service.core.conversation import Conversations
from service.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    StoreUnavailable,
    Unavailable,
)
from service.core.estimate import TokenCalibration
from service.core.ids import new_turn_id, request_hash
from service.core.model import EventKind, OnBusy, Session, SessionEvent, Turn, TurnState
from service.core.ports import Acting, Enqueue, Promoted, StartOutcomeKind, TurnStart
from service.core.projects import ProjectDirectory
from service.core.sessions import check_request_id
from service.core.turn import ending as endings
from service.core.turn.early import EarlyCall
from service.core.turn.ending import Ending, close_stored_turn
from service.core.turn.events import EventBuilder, Totals
from service.core.turn.leases import Leases
from service.core.turn.loop import Step, TurnLoop
from service.core.turn.prompt import PromptSource
from service.core.turn.settings import TurnDependencies
from service.core.turn.state import TurnHandle
from service.core.turn.telling import StoreThenTell

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Attempts to open a turn while an expired one is being closed.
_START_ATTEMPTS = 3
#: Shutdown (``TurnService.stop``): seconds kept after the writes' ``cancel_grace`` for
#: a stopped turn to store its end (docs/spec/turn-loop.md: ``turn_ended`` within ``cancel_grace`` +
#: 1 s), and, of those, the last ones for closing from the store the runs that did not.
STOP_MARGIN_S = 1.0
CLOSE_MARGIN_S = 0.5
#: Sessions whose last request id is kept, so that a retried message opens no early
#: model call (decision 0380).
_KEPT_REQUEST_IDS = 10_000


@dataclass(frozen=True)
class SendRequest:
    """A human message for a session; ``token`` is the human's bearer token."""

    session: Session
    human_id: str
    organization_id: str
    token: str
    text: str
    request_id: str
    #: What to do when a turn of the session runs (decision 0300).
    on_busy: OnBusy = OnBusy.REJECT


@dataclass(frozen=True)
class Accepted:
    """A message accepted (or a duplicate of one): the turn and its stored
    ``message_accepted`` event, or ``message_queued`` when the message waits as a
    queued turn (``queued``)."""

    turn: Turn
    message_accepted: SessionEvent
    duplicate: bool

    @property
    def queued(self) -> bool:
        """Whether the message was stored as a queued turn (decision 0300)."""
        return self.message_accepted.kind is EventKind.MESSAGE_QUEUED


class TurnService:
    """Runs the turns of this replica: start, cancel, leases and recovery.

    ``on_step``, when given, sees every step of every turn (tests).
    """

    def __init__(
        self, deps: TurnDependencies, *, on_step: Callable[[str, Step], None] | None = None
    ) -> None:
        settings = deps.settings
        self._deps = deps
        directory = deps.projects or ProjectDirectory(
            deps.backends,
            deps.clock,
            cache_s=settings.prompt_cache_s,
            timeout_s=settings.dependency_timeout_s,
        )
        self._prompts = PromptSource(
            directory, model=settings.model, declarations=deps.declarations
        )
        self._conversations = Conversations(max_bytes=settings.conversation_cache_bytes)
        #: Per session, the request id of the turn last started here (decision 0380).
        self._last_requests: OrderedDict[str, str] = OrderedDict()
        self._handles: dict[str, TurnHandle] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._accepting_tasks: set[asyncio.Task[Accepted]] = set()
        self._leases = Leases(deps, self._handles, self._promoted)
        self._promoting: set[asyncio.Task[None]] = set()
        #: Reads of starts whose commit was not confirmed (decision 0372).
        self._confirming: set[asyncio.Task[None]] = set()
        self._on_step = on_step
        self._accepting = True
        #: Set by ``stop``: every turn launched from then on stops at once.
        self._stopping: Ending | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Close the turns this replica owned in an earlier life, then start renewing
        leases and sweeping."""
        with contextlib.suppress(StoreUnavailable):
            for turn in await self._deps.store.running_turns(owner=self._deps.replica_id):
                if turn.turn_id not in self._handles:
                    await self._close(turn, endings.INTERRUPTED, owner=self._deps.replica_id)
        self._leases.start()

    async def stop(self, grace_s: float) -> None:
        """Shut this replica's turns down within ``grace_s`` seconds (docs/spec/operations.md,
        graceful shutdown; decision 0181):

        1. refuse new messages (``UNAVAILABLE``/``SHUTTING_DOWN``); messages being
           accepted launch their turns;
        2. let running turns end on their own while the period leaves room for a stop,
           until ``grace_s - cancel_grace - STOP_MARGIN_S``;
        3. stop the rest ``INTERRUPTED`` ("the planner is shutting down"): the model
           stream stops and reads are abandoned at once, started writes get
           ``cancel_grace``, and each turn stores its own end;
        4. at ``grace_s - CLOSE_MARGIN_S``, cancel the runs that have not stored their
           end and close their turns from what is stored.

        Every turn of this process has ended in the database when this returns, unless
        the database is unreachable (the turn's lease then lapses and a sweeper closes
        it). The settings loader makes sure ``server.grace_s`` leaves room for
        ``cancel_grace`` (``service.config``); a shorter ``grace_s`` (tests, a second
        stop) skips to the stop at once and shortens the writes' grace.
        """
        self._accepting = False
        for task in self._confirming:
            # An unconfirmed start left now lapses to a sweeper (decision 0372).
            task.cancel()
        deadline = self._deps.clock.monotonic() + grace_s
        settings = self._deps.settings

        await self._wait_for_runs(deadline - settings.cancel_grace_s - STOP_MARGIN_S)
        # From here a turn launched by an acceptance still in flight stops at once too.
        self._stopping = endings.SHUTTING_DOWN
        for handle in list(self._handles.values()):
            handle.request_stop(endings.SHUTTING_DOWN)
        await self._wait_for_runs(deadline - CLOSE_MARGIN_S)
        stuck = [handle.turn_id for handle in self._handles.values()]
        tasks = set(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            # A cancelled run stops at its next await; the commit it may be in is the
            # store's to finish (store units of work are not cancelled with callers).
            await asyncio.wait(tasks)
        for turn_id in stuck:
            with contextlib.suppress(StoreUnavailable):
                turn = await self._deps.store.get_turn(turn_id)
                if turn is not None and turn.state is TurnState.RUNNING:
                    await self._close(turn, endings.SHUTTING_DOWN, owner=self._deps.replica_id)
        await self._leases.stop()

    async def _wait_for_runs(self, until: float) -> None:
        """Wait until no message is being accepted and no turn runs here, or until the
        clock's ``monotonic()`` reads ``until`` (seconds); turns launched meanwhile are
        waited for too."""
        while True:
            waiting = set(self._accepting_tasks) | set(self._tasks.values())
            timeout_s = until - self._deps.clock.monotonic()
            if not waiting or timeout_s <= 0:
                return
            await asyncio.wait(waiting, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)

    @property
    def running_sessions(self) -> set[str]:
        """The sessions whose turn runs in this process."""
        return {handle.session_id for handle in self._handles.values()}

    @property
    def running(self) -> int:
        """Turns running in this process."""
        return len(self._handles)

    @property
    def calibration(self) -> TokenCalibration:
        """What this process learned of the model's token count (decision 0350)."""
        return self._deps.calibration

    # ------------------------------------------------------------------ requests

    async def send_message(self, request: SendRequest) -> Accepted:
        """Store the human message and open the turn, then run it (docs/spec/turn-loop.md step 1).

        Raises ``InvalidArgument`` (``REQUEST_ID_REQUIRED``, ``REQUEST_ID_TOO_LONG``,
        ``REQUEST_ID_REUSED``, ``MESSAGE_TOO_LONG``, ``EMPTY_MESSAGE``),
        ``FailedPrecondition`` (``TURN_IN_PROGRESS``), ``ResourceExhausted``
        (``TOO_MANY_TURNS``), ``NotFound`` (the session is gone), ``Unavailable``
        (shutting down, database down).
        """
        check_request_id(request.request_id, required=True)
        limit = self._deps.settings.message_max_bytes
        size = len(request.text.encode())
        if size > limit:
            raise InvalidArgument(
                f"the message is {size} bytes; at most {limit}", reason="MESSAGE_TOO_LONG"
            )
        if not request.text.strip():
            raise InvalidArgument("the message is empty", reason="EMPTY_MESSAGE")
        if not self._accepting:
            raise Unavailable("the planner is shutting down", reason="SHUTTING_DOWN")
        task = asyncio.get_running_loop().create_task(self._accept(request))
        self._accepting_tasks.add(task)
        task.add_done_callback(self._accepted)
        # Shielded: a caller cancelled here leaves the task to commit and launch.
        return await asyncio.shield(task)

    def _accepted(self, task: asyncio.Task[Accepted]) -> None:
        self._accepting_tasks.discard(task)
        if not task.cancelled():
            # Read, so that a refusal nobody awaits any more is not reported as lost.
            task.exception()

    async def _accept(self, request: SendRequest) -> Accepted:
        session = request.session
        settings = self._deps.settings
        for _attempt in range(_START_ATTEMPTS):
            now = self._deps.clock.now()
            turn_id = new_turn_id()
            events = EventBuilder(session.session_id, turn_id, request.human_id, self._deps.clock)
            accepted = events.message_accepted(request.text, request.request_id)
            assert accepted.message is not None
            enqueue = None
            if request.on_busy is not OnBusy.REJECT:
                enqueue = Enqueue(
                    on_busy=request.on_busy,
                    max_queued=settings.max_queued,
                    token=request.token,
                    event=events.message_queued(request.text, request.on_busy, request.request_id),
                )
            turn = Turn(
                turn_id=turn_id,
                session_id=session.session_id,
                human_id=request.human_id,
                state=TurnState.RUNNING,
                start_time=now,
                request_id=request.request_id,
                request_hash=request_hash(request.text),
                model=settings.model,
                owner=self._deps.replica_id,
                lease_expires_at=now + timedelta(seconds=settings.lease_s),
            )
            acting = Acting(
                human_id=request.human_id,
                organization_id=request.organization_id,
                token=request.token,
                session_id=session.session_id,
            )
            starting = asyncio.get_running_loop().create_task(
                self._deps.store.start_turn(
                    TurnStart(
                        turn=turn,
                        project_id=session.project_id,
                        message=accepted.message,
                        events=[accepted, events.turn_started(settings.model, settings.max_rounds)],
                        limits=settings.running_limits,
                        now=now,
                        enqueue=enqueue,
                    )
                ),
                name="turn start",
            )
            try:
                # Two passes of the event loop: ``start_turn`` hands its unit of work to
                # the store, and the unit builds and sends its statement. Only then is the
                # first model call's request built, so that PostgreSQL runs the start
                # while this process builds and sends the request (decision 0394). Only
                # an ordering: a unit still waiting for a connection changes nothing else.
                await asyncio.sleep(0)
                await asyncio.sleep(0)
            except BaseException:
                # The unit of work goes on, owned by the store; nobody waits for it here.
                starting.cancel()
                raise
            # The first model call, opened now and taken over by the turn once the start
            # is durable; cancelled if it is not (decision 0380).
            early = None
            if self._last_requests.get(session.session_id) != request.request_id:
                # (A retry of the message last sent here is a duplicate: no model call.)
                early = EarlyCall.start(
                    self._deps,
                    self._prompts,
                    self._conversations,
                    turn=turn,
                    session=session,
                    acting=acting,
                    message=accepted.message,
                )
            try:
                outcome = await starting
            except StoreUnavailable:
                if early is not None:
                    early.cancel()
                # The commit may have landed with its reply lost (decision 0372).
                self._confirm_start(turn, session, acting)
                raise
            except BaseException:
                if early is not None:
                    early.cancel()
                raise
            if early is not None and outcome.kind is not StartOutcomeKind.STARTED:
                early.cancel()
            if outcome.kind is StartOutcomeKind.EXPIRED_TURN:
                await self._close(outcome.turn, endings.LEASE_EXPIRED, lease_expired_before=now)
                continue
            if outcome.kind is StartOutcomeKind.DUPLICATE:
                return Accepted(outcome.turn, outcome.events[0], duplicate=True)
            if outcome.kind is StartOutcomeKind.QUEUED:
                StoreThenTell.of(self._deps).tell(outcome.events, outcome.turn)
                if outcome.interrupted is not None:
                    handle = self._handles.get(outcome.interrupted.turn_id)
                    if handle is not None:
                        handle.request_stop(endings.INTERRUPTED_BY_MESSAGE)
                if outcome.join_into is not None:
                    handle = self._handles.get(outcome.join_into.turn_id)
                    if handle is not None:
                        handle.join_pending = True
                return Accepted(outcome.turn, outcome.events[0], duplicate=False)
            stored = list(outcome.events)
            self._remember_request(session.session_id, request.request_id)
            handle = TurnHandle(outcome.turn, session, acting, stored[0].sequence)
            handle.early = early
            # Told before the turn is launched (decision 0399): the streams' writers
            # start writing these events, which a first delta must follow, before the
            # turn's first steps run; its first model call is open already.
            StoreThenTell.of(self._deps).tell(stored, outcome.turn)
            self._launch(handle)
            return Accepted(outcome.turn, stored[0], duplicate=False)
        raise FailedPrecondition("a turn is still closing; try again", reason="TURN_IN_PROGRESS")

    def _confirm_start(self, turn: Turn, session: Session, acting: Acting) -> None:
        """Find out, in a task of its own, whether a start that failed ``StoreUnavailable``
        stored ``turn`` after all, and run it if so (decision 0372)."""
        task = asyncio.get_running_loop().create_task(
            self._run_if_stored(turn, session, acting), name=f"confirm {turn.turn_id}"
        )
        self._confirming.add(task)
        task.add_done_callback(self._confirming.discard)

    async def _run_if_stored(self, turn: Turn, session: Session, acting: Acting) -> None:
        """Read ``turn`` back until the database answers, at most until its lease
        expires (a sweeper closes it then), and launch it when it is stored running,
        owned here, and not running yet. A start whose reply was lost (the connection
        broke during its commit; a failover to a synchronous standby) stored the human's
        message and a running turn that nothing else would run: it held the session
        (``TURN_IN_PROGRESS``) until its lease expired. Run, it answers the message, and
        a retry of the message (same request id) gets this turn as a duplicate."""
        deps = self._deps
        expires = turn.lease_expires_at
        delay = 0.05
        while True:
            try:
                stored = await deps.store.get_turn(turn.turn_id)
                break
            except StoreUnavailable:
                if expires is None or deps.clock.now() >= expires:
                    return
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
        if (
            stored is None
            or stored.state is not TurnState.RUNNING
            or stored.owner != deps.replica_id
            or stored.turn_id in self._handles
            or not self._accepting
        ):
            return
        log.warning(
            "a turn whose start was not confirmed was stored; running it",
            extra={"session": stored.session_id, "turn": stored.turn_id},
        )
        self._remember_request(session.session_id, stored.request_id)
        self._launch(TurnHandle(stored, session, acting, stored.human_sequence))

    def _remember_request(self, session_id: str, request_id: str) -> None:
        """Keep the request id of the turn last started in ``session_id`` (at most
        ``_KEPT_REQUEST_IDS`` sessions): a retry of it opens no early model call."""
        requests = self._last_requests
        requests.pop(session_id, None)
        requests[session_id] = request_id
        if len(requests) > _KEPT_REQUEST_IDS:
            requests.popitem(last=False)

    async def wait_for_end(self, turn_id: str) -> Turn:
        """Wait until a turn has ended and return it (unary ``SendMessage``); the
        caller's deadline bounds the wait, the turn goes on regardless. Raises
        ``NotFound``, ``Unavailable``."""
        handle = self._handles.get(turn_id)
        if handle is not None:
            await handle.done.wait()
        delay = 0.05
        while True:
            turn = await self._deps.store.get_turn(turn_id)
            if turn is None:
                raise NotFound("the turn does not exist", reason="TURN_NOT_FOUND")
            if turn.state is TurnState.ENDED:
                return turn
            # A turn another replica runs: poll its row (this path is rare).
            await asyncio.sleep(delay)
            delay = min(0.5, delay * 2)

    async def cancel(self, session: Session, turn_id: str) -> Turn:
        """Cancel a turn of ``session``; an ended turn is returned unchanged.

        ``turn_id`` empty means the running turn (``NotFound`` when there is none).
        Takes effect within 1 s on whichever replica runs the turn (docs/spec/api-and-streams.md).
        """
        store = self._deps.store
        if not turn_id:
            turn_id = session.running_turn_id
            if not turn_id:
                raise NotFound("no turn is running", reason="TURN_NOT_FOUND")
        turn = await store.get_turn(turn_id)
        if turn is None or turn.session_id != session.session_id:
            raise NotFound("the turn does not exist", reason="TURN_NOT_FOUND")
        if turn.state is TurnState.QUEUED:
            # Ended without running: nothing is sent to the model (decision 0300).
            events = EventBuilder(turn.session_id, turn.turn_id, turn.human_id, self._deps.clock)
            ended = await store.cancel_queued(
                turn_id, events.turn_ended(endings.CANCELLED.reason, Totals())
            )
            StoreThenTell.of(self._deps).tell(ended, turn)
            # Else it started (or ended) meanwhile: cancelled as a running turn below.
            turn = await store.get_turn(turn_id)
            if turn is None:
                raise NotFound("the turn does not exist", reason="TURN_NOT_FOUND")
        if turn.state is TurnState.ENDED:
            return turn
        handle = self._handles.get(turn_id)
        deadline = self._deps.settings.cancel_grace_s + 1.0
        if handle is not None:
            handle.request_stop(endings.CANCELLED)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(handle.done.wait(), timeout=deadline)
        else:
            now = self._deps.clock.now()
            if turn.lease_expires_at is not None and turn.lease_expires_at <= now:
                await self._close(turn, endings.LEASE_EXPIRED, lease_expired_before=now)
            else:
                await store.request_cancel(turn_id)
                started = self._deps.clock.monotonic()
                delay = 0.02
                while self._deps.clock.monotonic() - started < deadline:
                    current = await store.get_turn(turn_id)
                    if current is None or current.state is TurnState.ENDED:
                        break
                    await asyncio.sleep(delay)
                    delay = min(0.2, delay * 2)
        final = await store.get_turn(turn_id)
        if final is None:
            raise NotFound("the turn does not exist", reason="TURN_NOT_FOUND")
        return final

    async def on_remote_cancel(self, turn_id: str) -> None:
        """A signal for a turn from another replica (via the notifier): ``CancelTurn``,
        an INTERRUPT (the turn's ``cancel_reason`` says which; decision 0301), or a JOIN
        message waiting (``join_pending``; decision 0303). The row is read to tell them
        apart; when that fails, the next lease renewal tells."""
        handle = self._handles.get(turn_id)
        if handle is None:
            return
        try:
            turn = await self._deps.store.get_turn(turn_id)
        except StoreUnavailable:
            return
        if turn is None:
            return
        if turn.cancel_requested:
            handle.request_stop(endings.cancel_ending(turn.cancel_reason))
        elif turn.join_pending:
            handle.join_pending = True

    def on_session_deleted(self, session_id: str) -> None:
        """``DeleteSession`` removed a session: stop its turn here at once
        (docs/spec/api-and-streams.md). Nothing of it can be stored any more, so the run ends at its
        next commit without one."""
        for handle in list(self._handles.values()):
            if handle.session_id == session_id:
                handle.request_stop(endings.CANCELLED)

    async def sweep(self) -> int:
        """Close every running turn whose lease expired (see ``Leases.sweep``)."""
        return await self._leases.sweep()

    # ------------------------------------------------------------------ runs

    def _launch(self, handle: TurnHandle) -> None:
        turn_id = handle.turn_id
        self._handles[turn_id] = handle
        self._deps.observer.turn_started()
        on_step = self._on_step
        loop = TurnLoop(
            self._deps,
            self._prompts,
            handle,
            conversations=self._conversations,
            on_step=(lambda step: on_step(turn_id, step)) if on_step is not None else None,
            on_promoted=self._promoted,
        )
        task = asyncio.get_running_loop().create_task(loop.run(), name=f"turn {turn_id}")
        self._tasks[turn_id] = task

        # A done callback, not a finally: it runs even for a task cancelled before it
        # started (shutdown), so no handle outlives its run.
        def ended(_: asyncio.Task[None]) -> None:
            self._handles.pop(turn_id, None)
            self._tasks.pop(turn_id, None)
            # A run cancelled before its first model call (decision 0380).
            handle.drop_early()
            handle.done.set()

        task.add_done_callback(ended)
        if self._stopping is not None:
            handle.request_stop(self._stopping)

    def _promoted(self, promoted: Promoted, session: Session | None) -> None:
        """Launch a queued turn that an ending on this replica started (decision 0300).
        Without the session at hand it is read first; if that fails the turn's lease
        lapses and a sweeper closes it, starting the next."""
        if session is not None:
            self._launch_promoted(promoted, session)
            return
        task = asyncio.get_running_loop().create_task(self._read_and_launch(promoted))
        self._promoting.add(task)
        task.add_done_callback(self._promoting.discard)

    async def _read_and_launch(self, promoted: Promoted) -> None:
        try:
            session = await self._deps.store.get_session(promoted.turn.session_id)
        except StoreUnavailable:
            log.warning("a queued turn could not start: the database is unavailable")
            return
        if session is not None:
            self._launch_promoted(promoted, session)

    def _launch_promoted(self, promoted: Promoted, session: Session) -> None:
        turn = promoted.turn
        acting = Acting(
            human_id=turn.human_id,
            organization_id=session.organization_id,
            token=promoted.token,
            session_id=session.session_id,
        )
        self._launch(TurnHandle(turn, session, acting, turn.human_sequence))

    async def _close(
        self,
        turn: Turn,
        ending: Ending,
        *,
        owner: str | None = None,
        lease_expired_before: datetime | None = None,
    ) -> bool:
        deps = self._deps
        return await close_stored_turn(
            deps.store,
            deps.hub,
            deps.clock,
            deps.observer,
            turn,
            ending,
            owner=owner,
            lease_expired_before=lease_expired_before,
            promote=endings.promotion(deps),
            on_promoted=self._promoted,
        )
