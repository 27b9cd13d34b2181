"""The turn service: starting, cancelling, recovering turns (SPEC sections 3 and 5).

``TurnService`` is what the transport calls: ``send_message`` stores the human message
and opens the turn in one transaction, then runs it as its own task with a
``TurnRunner`` (``service/core/run.py``), so a client that disconnects does not stop it;
``cancel`` stops a turn on whichever replica runs it; ``wait_for_end`` serves unary
``SendMessage``. A running turn holds a lease its replica renews; the sweeper closes
turns whose lease expired ``INTERRUPTED`` (``service/core/recovery.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TypeVar

from service.core.context import build_system_prompt, to_model_messages
from service.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    StoreUnavailable,
    Unavailable,
)
from service.core.ids import new_id, request_hash
from service.core.model import (
    EventKind,
    Message,
    MessageKind,
    Session,
    SessionEvent,
    Turn,
    TurnEndReason,
    TurnStartedData,
    TurnState,
)
from service.core.ports import (
    Acting,
    StartOutcomeKind,
    TurnStart,
)
from service.core.recovery import close_turn, synthetic_outcome
from service.core.run import (
    NullObserver,
    Run,
    Stop,
    TurnDependencies,
    TurnObserver,
    TurnRunner,
    TurnSettings,
    run_fields,
)
from service.core.sessions import check_request_id

__all__ = [
    "Accepted",
    "NullObserver",
    "SendRequest",
    "TurnDependencies",
    "TurnObserver",
    "TurnService",
    "TurnSettings",
    "build_system_prompt",
    "new_id",
    "request_hash",
    "synthetic_outcome",
    "to_model_messages",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class SendRequest:
    """A human message for a session; ``token`` is the human's bearer token."""

    session: Session
    human_id: str
    organization_id: str
    token: str
    text: str
    request_id: str


@dataclass(frozen=True)
class Accepted:
    """A message accepted (or a duplicate of one): the turn and its stored
    ``message_accepted`` event."""

    turn: Turn
    message_accepted: SessionEvent
    duplicate: bool


class TurnService:
    """Runs turns for this replica: start, cancel, lease renewal and recovery."""

    def __init__(self, deps: TurnDependencies) -> None:
        self._store = deps.store
        self._hub = deps.hub
        self._clock = deps.clock
        self._settings = deps.settings
        self._replica = deps.replica_id
        self._observer = deps.observer
        self._runner = TurnRunner(deps, on_finished=self._finished)
        self._runs: dict[str, Run] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._background: list[asyncio.Task[None]] = []
        self._accepting = True

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Close the turns this replica owned in an earlier life, then start the lease
        renewer and the sweeper."""
        with contextlib.suppress(StoreUnavailable):
            for turn in await self._store.running_turns(owner=self._replica):
                if turn.turn_id not in self._runs:
                    await self._interrupt(turn, owner=self._replica)
        loop = asyncio.get_running_loop()
        self._background = [
            loop.create_task(self._renew_loop(), name="turn-lease-renewer"),
            loop.create_task(self._sweep_loop(), name="turn-sweeper"),
        ]

    async def stop(self, grace_s: float) -> None:
        """Stop accepting turns, let running ones end within ``grace_s`` seconds, then
        close the rest ``INTERRUPTED`` (SPEC section 8, graceful shutdown)."""
        self._accepting = False
        runs = list(self._runs.values())
        if runs:
            await asyncio.wait(
                [asyncio.ensure_future(r.done.wait()) for r in runs],
                timeout=max(0.0, grace_s - 1.0),
            )
        for run in list(self._runs.values()):
            run.request_stop(
                Stop(TurnEndReason.INTERRUPTED, message="the planner is shutting down")
            )
        runs = list(self._runs.values())
        if runs:
            await asyncio.wait([asyncio.ensure_future(r.done.wait()) for r in runs], timeout=1.0)
        for task in self._background:
            task.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._background, *self._tasks, return_exceptions=True)

    @property
    def running(self) -> int:
        """Turns running in this process."""
        return len(self._runs)

    # ------------------------------------------------------------------ requests

    async def send_message(self, request: SendRequest) -> Accepted:
        """Step 1: store the human message and open the turn, then run it as a task.

        Raises ``InvalidArgument`` (``REQUEST_ID_REQUIRED``, ``REQUEST_ID_TOO_LONG``,
        ``REQUEST_ID_REUSED``, ``MESSAGE_TOO_LONG``, ``EMPTY_MESSAGE``),
        ``FailedPrecondition`` (``TURN_IN_PROGRESS``), ``ResourceExhausted``
        (``TOO_MANY_TURNS``), ``Unavailable`` (shutting down, database down).
        """
        check_request_id(request.request_id, required=True)
        size = len(request.text.encode())
        if size > self._settings.message_max_bytes:
            raise InvalidArgument(
                f"the message is {size} bytes; at most {self._settings.message_max_bytes}",
                reason="MESSAGE_TOO_LONG",
            )
        if not request.text.strip():
            raise InvalidArgument("the message is empty", reason="EMPTY_MESSAGE")
        if not self._accepting:
            raise Unavailable("the planner is shutting down", reason="SHUTTING_DOWN")
        session = request.session
        for _attempt in range(3):
            now = self._clock.now()
            turn_id = new_id("turn")
            message = Message(
                session_id=session.session_id,
                turn_id=turn_id,
                message_id=new_id("msg"),
                kind=MessageKind.HUMAN,
                create_time=now,
                text=request.text,
                human_id=request.human_id,
            )
            turn = Turn(
                turn_id=turn_id,
                session_id=session.session_id,
                human_id=request.human_id,
                state=TurnState.RUNNING,
                start_time=now,
                request_id=request.request_id,
                request_hash=request_hash(request.text),
                model=self._settings.model,
                owner=self._replica,
                lease_expires_at=now + timedelta(seconds=self._settings.lease_s),
            )
            events = [
                SessionEvent(
                    session.session_id, turn_id, EventKind.MESSAGE_ACCEPTED, now, message=message
                ),
                SessionEvent(
                    session.session_id,
                    turn_id,
                    EventKind.TURN_STARTED,
                    now,
                    data=TurnStartedData(self._settings.model, self._settings.max_rounds),
                ),
            ]
            outcome = await self._store_call(
                self._store.start_turn(
                    TurnStart(
                        turn=turn,
                        project_id=session.project_id,
                        message=message,
                        events=events,
                        limits=self._settings.running_limits,
                        now=now,
                    )
                )
            )
            if outcome.kind is StartOutcomeKind.EXPIRED_TURN:
                await self._interrupt(outcome.turn, lease_expired_before=now)
                continue
            if outcome.kind is StartOutcomeKind.DUPLICATE:
                return Accepted(outcome.turn, outcome.events[0], duplicate=True)
            stored = list(outcome.events)
            self._hub.publish(stored)
            accepted = stored[0]
            assert accepted.message is not None
            run = Run(
                turn=outcome.turn,
                session=session,
                acting=Acting(
                    human_id=request.human_id,
                    organization_id=request.organization_id,
                    token=request.token,
                    session_id=session.session_id,
                ),
                project_id=session.project_id,
                human_sequence=accepted.sequence,
            )
            self._launch(run)
            return Accepted(outcome.turn, accepted, duplicate=False)
        raise FailedPrecondition("a turn is still closing; try again", reason="TURN_IN_PROGRESS")

    async def wait_for_end(self, turn_id: str) -> Turn:
        """Wait until a turn has ended and return it (unary ``SendMessage``).

        The caller's deadline bounds the wait; the turn itself goes on regardless.
        """
        run = self._runs.get(turn_id)
        if run is not None:
            await run.done.wait()
        delay = 0.05
        while True:
            turn = await self._store_call(self._store.get_turn(turn_id))
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
        Takes effect within 1 s on whichever replica runs the turn (SPEC section 3).
        """
        if not turn_id:
            turn_id = session.running_turn_id
            if not turn_id:
                raise NotFound("no turn is running", reason="TURN_NOT_FOUND")
        turn = await self._store_call(self._store.get_turn(turn_id))
        if turn is None or turn.session_id != session.session_id:
            raise NotFound("the turn does not exist", reason="TURN_NOT_FOUND")
        if turn.state is TurnState.ENDED:
            return turn
        run = self._runs.get(turn_id)
        deadline = self._settings.cancel_grace_s + 1.0
        if run is not None:
            run.request_stop(Stop(TurnEndReason.CANCELLED))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.done.wait(), timeout=deadline)
        else:
            now = self._clock.now()
            if turn.lease_expires_at is not None and turn.lease_expires_at <= now:
                await self._interrupt(turn, lease_expired_before=now)
            else:
                await self._store_call(self._store.request_cancel(turn_id))
                started = time.monotonic()
                delay = 0.02
                while time.monotonic() - started < deadline:
                    current = await self._store_call(self._store.get_turn(turn_id))
                    if current is None or current.state is TurnState.ENDED:
                        break
                    await asyncio.sleep(delay)
                    delay = min(0.2, delay * 2)
        final = await self._store_call(self._store.get_turn(turn_id))
        if final is None:
            raise NotFound("the turn does not exist", reason="TURN_NOT_FOUND")
        return final

    def on_remote_cancel(self, turn_id: str) -> None:
        """A cancel requested on another replica (via the notifier)."""
        run = self._runs.get(turn_id)
        if run is not None:
            run.request_stop(Stop(TurnEndReason.CANCELLED))

    def on_session_deleted(self, session_id: str) -> None:
        """``DeleteSession`` removed a session: stop its turn here at once (SPEC 3: the
        delete cancels the running turn). Nothing of it can be stored any more, so the
        run ends at its next commit without one."""
        for run in list(self._runs.values()):
            if run.session.session_id == session_id:
                run.request_stop(Stop(TurnEndReason.CANCELLED))

    # ------------------------------------------------------------------ runs

    def _launch(self, run: Run) -> None:
        self._runs[run.turn.turn_id] = run
        self._observer.turn_started()
        task = asyncio.get_running_loop().create_task(
            self._runner.run(run), name=f"turn {run.turn.turn_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _finished(self, run: Run) -> None:
        self._runs.pop(run.turn.turn_id, None)

    async def _store_call(self, operation: Awaitable[T]) -> T:
        try:
            return await operation
        except StoreUnavailable as error:
            raise Unavailable(
                "the database is unavailable", reason="DATABASE_UNAVAILABLE"
            ) from error

    # ------------------------------------------------------------------ recovery

    async def _interrupt(
        self,
        turn: Turn,
        *,
        owner: str | None = None,
        lease_expired_before: datetime | None = None,
    ) -> None:
        """Close a turn no run of this process holds ``INTERRUPTED`` (``close_turn``)."""
        await close_turn(
            self._store,
            self._hub,
            self._clock,
            self._observer,
            turn,
            owner=owner,
            lease_expired_before=lease_expired_before,
        )

    async def _renew_loop(self) -> None:
        interval = self._settings.lease_s / 3
        while True:
            await asyncio.sleep(interval)
            for run in list(self._runs.values()):
                if run.done.is_set():
                    continue
                until = self._clock.now() + timedelta(seconds=self._settings.lease_s)
                try:
                    status = await self._store.renew_lease(run.turn.turn_id, self._replica, until)
                except StoreUnavailable:
                    continue
                except Exception:
                    log.exception("lease renewal failed", extra=run_fields(run))
                    continue
                if not status.held:
                    # Another replica closed it: stop without storing anything more.
                    run.request_stop(Stop(TurnEndReason.INTERRUPTED))
                elif status.cancel_requested:
                    run.request_stop(Stop(TurnEndReason.CANCELLED))

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self._settings.sweep_interval_s)
            try:
                await self.sweep()
            except StoreUnavailable:
                continue
            except Exception:
                log.exception("sweeping expired turns failed")

    async def sweep(self) -> int:
        """Close every running turn whose lease expired; returns how many this call
        closed (other replicas may race for the same turns; one wins each)."""
        now = self._clock.now()
        closed = 0
        for turn in await self._store.running_turns(lease_expired_before=now):
            if turn.turn_id in self._runs:
                continue
            await self._interrupt(turn, lease_expired_before=now)
            closed += 1
        return closed
