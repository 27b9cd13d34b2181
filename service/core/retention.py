"""Retention: idle sessions deleted by a bounded pass, and one human's sessions erased.

What counts (docs/decisions/0250-retention-activity-and-batches.md): a session is idle
for ``idle_days`` when nothing was written to it for that long. Its last activity is the
latest of its creation, its last title change or compaction (``update_time``) and its
latest stored session event (a message accepted, an answer, a tool call or result, a
turn started or ended, a compaction, a changeset proposed, knowledge written). Reading
does not count: opening a Chat stream, ``GetSession``, ``ListSessions`` and
``ListMessages`` write nothing. A session with a running turn is never deleted, however
old its last event.

How it deletes: a session goes with everything stored under it (messages, events,
turns, the idempotency keys of its turns and of the ``CreateSession`` that made it), in
one transaction, so nobody sees half a session. A batch deletes at most
``PurgeBounds.max_sessions`` sessions holding at most ``max_events`` session events in
all (a single larger session is deleted alone); the store re-checks every condition on
the rows it has locked, so a session that became active or started a turn since it was
read is left. Streams attached to a deleted session end ``NOT_FOUND``, on this replica
through ``on_deleted`` and on the others through the store's notification, as after
``DeleteSession``.

Who runs it (decision 0251): an idle pass holds the store's pass lock
(``RetentionStore.exclusively``: a PostgreSQL advisory lock), so one replica at a time
runs one, whether it is a replica's ``RetentionJob`` or ``ballet-planner purge``; a
pass that finds the lock taken does nothing. An erasure (decision 0252) takes no lock:
it deletes by the same re-checked batches, after cancelling the human's running turns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Protocol, TypeVar

from service.core.errors import StoreUnavailable
from service.core.ports import Clock, SessionStore

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds between two looks at an erased human's running turns while they end.
CANCEL_POLL_S = 0.2


class PurgeReason(StrEnum):
    """Why sessions were deleted: the ``reason`` label of the retention metrics."""

    IDLE = "idle"
    ERASURE = "erasure"


class PassOutcome(StrEnum):
    """How a pass of the retention job ended: the ``outcome`` label of its metric."""

    COMPLETED = "completed"
    #: Another replica (or a ``ballet-planner purge``) held the pass lock.
    SKIPPED = "skipped"
    FAILED = "failed"


@dataclass(frozen=True)
class PurgeBounds:
    """How much one pass does at a time.

    ``max_sessions`` sessions per batch (one transaction each), whose session events add
    up to at most ``max_events`` (a single session with more is deleted alone);
    ``pause_s`` seconds between batches, so a backlog never keeps the database busy;
    ``scan`` sessions read per window while looking for idle ones (a read without
    locks)."""

    max_sessions: int = 100
    max_events: int = 10_000
    pause_s: float = 0.1
    scan: int = 1000

    def __post_init__(self) -> None:
        if self.max_sessions < 1 or self.max_events < 1 or self.scan < 1:
            raise ValueError(f"retention bounds must be positive: {self}")
        if self.pause_s < 0:
            raise ValueError(f"retention pause must not be negative: {self.pause_s}")


@dataclass(frozen=True)
class Candidate:
    """A session as a window of the store shows it.

    ``last_activity`` is the latest of ``update_time`` and its latest event's time;
    ``events`` its session events (``last_sequence``), the weight a batch is bounded by;
    ``running`` whether a turn of it is running now."""

    session_id: str
    last_activity: datetime
    events: int
    running: bool


@dataclass(frozen=True)
class Window:
    """One bounded read of candidates, in the store's order; ``next`` is where the next
    window starts (an opaque cursor), None after the last."""

    candidates: tuple[Candidate, ...]
    next: object | None


@dataclass(frozen=True)
class Deleted:
    """What one batch deleted: the sessions' ids and how many messages they held."""

    session_ids: tuple[str, ...] = ()
    messages: int = 0


#: Asks whether the pass lock is still held (its connection alive); a pass stops when not.
LockCheck = Callable[[], Awaitable[bool]]


class RetentionStore(Protocol):
    """What retention needs of the database. Every method raises ``StoreUnavailable``
    when the database cannot be reached."""

    async def exclusively(self, work: Callable[[LockCheck], Awaitable[T]]) -> T | None:
        """Run ``work`` holding the pass lock, or return None at once when another
        process holds it. ``work`` gets a check that the lock still holds."""
        ...

    async def idle_window(self, idle_before: datetime, after: object | None, limit: int) -> Window:
        """Up to ``limit`` sessions whose ``update_time`` is before ``idle_before``,
        from ``after`` (a window's ``next``; None: the start). Some may have later
        events or a running turn: the caller filters."""
        ...

    async def human_window(self, human_id: str, after: object | None, limit: int) -> Window:
        """Up to ``limit`` of the sessions ``human_id`` owns, from ``after``."""
        ...

    async def delete_sessions(
        self,
        session_ids: Sequence[str],
        *,
        idle_before: datetime | None = None,
        owner_id: str | None = None,
    ) -> Deleted:
        """Delete those of ``session_ids`` that, re-checked on their locked rows, have no
        running turn, were last active before ``idle_before`` (when given) and belong to
        ``owner_id`` (when given); one transaction, which also tells the other replicas.
        Sessions being written right now are left for a later batch."""
        ...

    async def count_messages(self, session_ids: Sequence[str]) -> int:
        """Messages stored in those sessions (dry runs)."""
        ...

    async def running_turns_of(self, human_id: str) -> list[str]:
        """Ids of the running turns ``human_id`` started."""
        ...

    async def count_sessions_of(self, human_id: str) -> int:
        """Sessions ``human_id`` owns."""
        ...

    async def stream_slots_of(self, human_id: str, *, delete: bool) -> int:
        """The rows counting ``human_id``'s open Chat streams (decision 0080): how many,
        and deleted with ``delete``."""
        ...


class PurgeObserver(Protocol):
    """Where retention reports what it did (the metrics)."""

    def deleted(self, reason: PurgeReason, sessions: int, messages: int) -> None: ...

    def pass_ended(self, outcome: PassOutcome, at: datetime) -> None: ...


class NullPurgeObserver:
    """Reports nowhere."""

    def deleted(self, reason: PurgeReason, sessions: int, messages: int) -> None:
        """Nothing."""

    def pass_ended(self, outcome: PassOutcome, at: datetime) -> None:
        """Nothing."""


@dataclass(frozen=True)
class PassReport:
    """What an idle pass did (or, with ``dry_run``, would do now).

    ``idle_before``: the cutoff (now minus the idle days); ``skipped``: another process
    held the pass lock, nothing was done; ``stopped``: the pass ended early because the
    job is stopping (the rest is left for the next one)."""

    idle_before: datetime
    sessions: int = 0
    messages: int = 0
    batches: int = 0
    skipped: bool = False
    stopped: bool = False
    dry_run: bool = False


@dataclass(frozen=True)
class ErasureReport:
    """What an erasure of ``human_id`` did (or, with ``dry_run``, would do).

    ``running_turns``: the human's turns running at the start (cancelled first unless
    ``dry_run``); ``stream_slots``: rows of their open Chat streams (deleted);
    ``left``: sessions still theirs at the end, because a turn in them did not end in
    time or they were created meanwhile (0 when the erasure is complete)."""

    human_id: str
    sessions: int = 0
    messages: int = 0
    batches: int = 0
    running_turns: int = 0
    stream_slots: int = 0
    left: int = 0
    dry_run: bool = False

    @property
    def complete(self) -> bool:
        """Nothing of the human is left in the planner's database."""
        return self.left == 0


def batches(candidates: Sequence[Candidate], bounds: PurgeBounds) -> list[list[Candidate]]:
    """Split ``candidates`` (in order) into batches of at most ``bounds.max_sessions``
    sessions holding at most ``bounds.max_events`` events in all; a session above
    ``max_events`` alone makes a batch of one."""
    made: list[list[Candidate]] = []
    current: list[Candidate] = []
    weight = 0
    for candidate in candidates:
        full = len(current) >= bounds.max_sessions or weight + candidate.events > bounds.max_events
        if current and full:
            made.append(current)
            current, weight = [], 0
        current.append(candidate)
        weight += candidate.events
    if current:
        made.append(current)
    return made


def idle_cutoff(now: datetime, idle_days: int) -> datetime:
    """The moment before which a session's last activity makes it idle."""
    if idle_days < 1:
        raise ValueError(f"idle_days must be at least 1, got {idle_days}")
    return now - timedelta(days=idle_days)


class Purger:
    """Runs idle passes and erasures on a ``RetentionStore``.

    ``sessions`` cancels an erased human's running turns; ``on_deleted`` ends this
    process's streams of deleted sessions (other replicas hear the store's notification);
    ``observer`` gets what was deleted. ``sleep`` waits between batches (tests pass one
    that returns at once)."""

    def __init__(
        self,
        store: RetentionStore,
        sessions: SessionStore,
        clock: Clock,
        bounds: PurgeBounds,
        *,
        on_deleted: Callable[[Sequence[str]], None] = lambda ids: None,
        observer: PurgeObserver | None = None,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self._store = store
        self._sessions = sessions
        self._clock = clock
        self._bounds = bounds
        self._on_deleted = on_deleted
        self._observer = observer or NullPurgeObserver()
        self._sleep = sleep
        self._stopping = False

    def stop(self) -> None:
        """End a pass in progress after its current batch (shutdown)."""
        self._stopping = True

    # ----------------------------------------------------------------- idle sessions

    async def purge_idle(self, idle_days: int, *, dry_run: bool = False) -> PassReport:
        """One pass over the sessions idle for ``idle_days`` days (at least 1).

        With ``dry_run``, counts what it would delete now and deletes nothing (and takes
        no lock). Otherwise holds the pass lock, or returns at once with ``skipped`` when
        another process holds it. Raises ``StoreUnavailable``, also when the lock's
        connection is lost mid-pass (what was deleted by then stays deleted).
        """
        cutoff = idle_cutoff(self._clock.now(), idle_days)
        if dry_run:
            return await self._count_idle(cutoff)
        report = await self._store.exclusively(lambda held: self._idle_pass(cutoff, held))
        if report is None:
            return PassReport(idle_before=cutoff, skipped=True)
        return report

    async def _count_idle(self, cutoff: datetime) -> PassReport:
        sessions = messages = 0
        after: object | None = None
        while True:
            window = await self._store.idle_window(cutoff, after, self._bounds.scan)
            ids = [c.session_id for c in _idle(window.candidates, cutoff)]
            if ids:
                sessions += len(ids)
                messages += await self._store.count_messages(ids)
            if window.next is None:
                return PassReport(cutoff, sessions, messages, dry_run=True)
            after = window.next

    async def _idle_pass(self, cutoff: datetime, held: LockCheck) -> PassReport:
        totals = _Totals()
        after: object | None = None
        while True:
            window = await self._store.idle_window(cutoff, after, self._bounds.scan)
            for batch in batches(_idle(window.candidates, cutoff), self._bounds):
                if self._stopping:
                    return totals.report(cutoff, stopped=True)
                if not await held():
                    raise StoreUnavailable("the retention pass lost its lock's connection")
                deleted = await self._store.delete_sessions(
                    [c.session_id for c in batch], idle_before=cutoff
                )
                self._deleted(PurgeReason.IDLE, deleted, totals)
                await self._sleep(self._bounds.pause_s)
            if window.next is None:
                return totals.report(cutoff)
            after = window.next

    # ----------------------------------------------------------------- erasure

    async def erase(
        self, human_id: str, *, dry_run: bool = False, cancel_wait_s: float = 30.0
    ) -> ErasureReport:
        """Delete every session ``human_id`` owns, with everything in them, and the rows
        of their open Chat streams (decision 0252).

        Their running turns are cancelled first and given ``cancel_wait_s`` seconds to
        end (a session with a running turn is never deleted); a session still running
        then, or created meanwhile, is counted in ``left``. With ``dry_run``, counts
        and changes nothing. Raises ``ValueError`` for an empty id, ``StoreUnavailable``.
        """
        if not human_id.strip():
            raise ValueError("the human id must not be empty")
        store = self._store
        running = await store.running_turns_of(human_id)
        if dry_run:
            return await self._count_human(human_id, len(running))
        for turn_id in running:
            await self._sessions.request_cancel(turn_id)
        if running:
            await self._wait_for_turns(human_id, cancel_wait_s)
        totals = _Totals()
        after: object | None = None
        while True:
            window = await store.human_window(human_id, after, self._bounds.scan)
            idle = [c for c in window.candidates if not c.running]
            for batch in batches(idle, self._bounds):
                deleted = await store.delete_sessions(
                    [c.session_id for c in batch], owner_id=human_id
                )
                self._deleted(PurgeReason.ERASURE, deleted, totals)
            if window.next is None:
                break
            after = window.next
        slots = await store.stream_slots_of(human_id, delete=True)
        left = await store.count_sessions_of(human_id)
        return ErasureReport(
            human_id,
            sessions=totals.sessions,
            messages=totals.messages,
            batches=totals.batches,
            running_turns=len(running),
            stream_slots=slots,
            left=left,
        )

    async def _count_human(self, human_id: str, running: int) -> ErasureReport:
        sessions = messages = 0
        after: object | None = None
        while True:
            window = await self._store.human_window(human_id, after, self._bounds.scan)
            ids = [c.session_id for c in window.candidates]
            if ids:
                sessions += len(ids)
                messages += await self._store.count_messages(ids)
            if window.next is None:
                break
            after = window.next
        slots = await self._store.stream_slots_of(human_id, delete=False)
        return ErasureReport(
            human_id,
            sessions=sessions,
            messages=messages,
            running_turns=running,
            stream_slots=slots,
            dry_run=True,
        )

    async def _wait_for_turns(self, human_id: str, wait_s: float) -> None:
        # A cancel takes effect within a second on the replica running the turn, which
        # then stores its end within planner.cancel_grace; a turn of a replica that died
        # is closed by the sweeper once its lease lapses.
        deadline = self._clock.monotonic() + wait_s
        while await self._store.running_turns_of(human_id):
            if self._clock.monotonic() >= deadline:
                return
            await asyncio.sleep(CANCEL_POLL_S)

    # ----------------------------------------------------------------- shared

    def _deleted(self, reason: PurgeReason, deleted: Deleted, totals: _Totals) -> None:
        totals.add(deleted)
        if deleted.session_ids:
            self._on_deleted(deleted.session_ids)
            self._observer.deleted(reason, len(deleted.session_ids), deleted.messages)


def _idle(candidates: Sequence[Candidate], cutoff: datetime) -> list[Candidate]:
    return [c for c in candidates if not c.running and c.last_activity < cutoff]


class _Totals:
    def __init__(self) -> None:
        self.sessions = self.messages = self.batches = 0

    def add(self, deleted: Deleted) -> None:
        self.batches += 1
        self.sessions += len(deleted.session_ids)
        self.messages += deleted.messages

    def report(self, cutoff: datetime, *, stopped: bool = False) -> PassReport:
        return PassReport(cutoff, self.sessions, self.messages, self.batches, stopped=stopped)


class RetentionJob:
    """A replica's background retention: an idle pass at start, then every
    ``interval_s`` seconds, for as long as the replica serves.

    A pass that fails (the database down) is logged and counted; the next one comes at
    the next interval. ``stop`` ends a pass in progress after its current batch."""

    def __init__(
        self,
        purger: Purger,
        idle_days: int,
        interval_s: float,
        clock: Clock,
        observer: PurgeObserver | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        idle_cutoff(clock.now(), idle_days)  # refuses idle_days < 1 now, not at the pass
        self._purger = purger
        self._idle_days = idle_days
        self._interval_s = interval_s
        self._clock = clock
        self._observer = observer or NullPurgeObserver()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the loop (in the running event loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="retention")

    async def stop(self) -> None:
        """Stop the loop; a pass in progress ends after its current batch (the store's
        units of work finish what they started, decision 0180)."""
        self._purger.stop()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def run_once(self) -> PassReport | None:
        """One pass now, logged and reported; None when it failed."""
        try:
            report = await self._purger.purge_idle(self._idle_days)
        except StoreUnavailable as error:
            log.warning("retention pass failed: the database is unavailable: %s", error)
            self._observer.pass_ended(PassOutcome.FAILED, self._clock.now())
            return None
        except Exception as error:
            log.error("retention pass failed: %s", type(error).__name__)
            self._observer.pass_ended(PassOutcome.FAILED, self._clock.now())
            return None
        if report.skipped:
            log.info("retention pass skipped: another planner holds the retention lock")
            self._observer.pass_ended(PassOutcome.SKIPPED, self._clock.now())
            return report
        if report.sessions:
            log.info(
                "retention: deleted %d idle session(s) with %d message(s), last active before %s",
                report.sessions,
                report.messages,
                report.idle_before.isoformat(timespec="seconds"),
            )
        if not report.stopped:
            self._observer.pass_ended(PassOutcome.COMPLETED, self._clock.now())
        return report

    async def _loop(self) -> None:
        while True:
            await self.run_once()
            await asyncio.sleep(self._interval_s)
