"""Units of work the store owns, so that no caller's cancellation reaches a connection
(decision 0180).

A unit of work holds a pooled connection from its first statement to its commit or
rollback. Cancelled inside, it has to run more awaits to give the connection back
cleanly: psycopg cancels the statement on the server and waits for it, SQLAlchemy rolls
back and returns the connection. A second cancellation during those (a client that
cancels an RPC whose handler is already cleaning up, a timeout around a cancelled wait)
leaves the connection checked out, possibly idle in a transaction that holds locks,
until the garbage collector drops it ("The garbage collector is trying to clean up
non-checked-in connection ...").

So cancellation never reaches one: every public coroutine method of a store class
marked ``@every_method_a_unit_of_work`` (and of its subclasses, marked too) is a unit of
work that runs in a task the store's ``UnitsOfWork`` owns, and its caller awaits the
unit's outcome, a future the task settles as its last step (decision 0398), never the
task itself. A caller cancelled meanwhile stops waiting at once; the unit of work runs
to its end, commits or rolls back, and returns its connection. What it did
is done whether or not anyone still waits for it: a commit that lands for a caller who
left is the same as one whose reply was lost on the network, which every caller already
handles (the turn service, for one, awaits its acceptance shielded and launches the
turn whatever happens to the RPC). ``UnitsOfWork.drain`` waits for the units in flight
before the pools close (``Database.close``).

With a tracer, a unit of work run within a traced operation (a turn, an RPC) is a span
``store.<method>`` of its own, opened in the unit's task so it ends with the unit, not
with a caller who left; one run outside any (lease renewal, the sweeper, heartbeats) is
not traced, so background upkeep sends no trace of its own (decision 0190).

A read (a method marked ``@read_unit``) is the exception to "runs to its end": nothing
is lost when one stops, and one waiting behind a lock would hold its connection for the
lock's whole duration though nobody waits for its answer. So a read whose caller left is
cancelled, once, ``abandoned_read_grace_s`` seconds later if it is still running: the
single cancellation makes psycopg cancel the statement on the server and wait for it,
and the connection goes back to its pool (a second cancellation is what 0180 rules
out, and the store never sends one).

Every unit of work has a deadline, ``unit_timeout_s`` (``database.unit_timeout_s``,
decision 0310): its pool checkout, statements and commit together. A database that went
silent (a black hole: no reset, no answer) would otherwise hold a unit of work on TCP's
retransmissions. Past it the caller gets ``StoreUnavailable`` at once, and the unit is
cancelled once (as a read whose caller left): psycopg then cancels the statement on the
server or, that failing, closes the connection within about 10 s; the socket's own
``tcp_user_timeout`` (``engine.SocketBounds``) aborts a connection whose data went
unacknowledged, so a statement sent into the hole is never delivered after it heals: a
caller told "unavailable" does not find its request executed later (a ``SendMessage``
either is acknowledged within the bound or fails, and is retried by its request id).
A deadline does not apply to a unit of work of a ``UnitsOfWork`` made without one (the
default: tests, the offline purge command).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from psycopg_pool import PoolTimeout
from sqlalchemy import exc as sa_exc

from service.core import tracing
from service.core.errors import PlannerError, StoreConflict, StoreUnavailable
from service.core.ports import Tracer

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

#: The attribute that marks a store method as a unit of work (tests check every public
#: coroutine method of the stores carries it).
MARK = "__unit_of_work__"
#: The attribute that marks a store method as a read (``read_unit``).
READ_MARK = "__read_unit__"
#: Seconds a read whose caller left may go on before it is cancelled (the default of
#: ``database.abandoned_read_grace_s``).
ABANDONED_READ_GRACE_S = 5.0

#: Failures of a unit of work that are the store's answers, not bugs.
_EXPECTED = (StoreUnavailable, StoreConflict, PlannerError)
#: The kinds of failed unit of work ``UnitsOfWork.on_failure`` reports (``failure_kind``).
FAILURE_KINDS = ("unavailable", "pool_timeout", "unexpected")


def failure_kind(error: BaseException) -> str | None:
    """What a unit of work that raised ``error`` says of the database: ``pool_timeout``
    (no pooled connection was free in time), ``unavailable`` (any other
    ``StoreUnavailable``: unreachable, a broken connection, a deadlock), None for the
    store's answers (a conflict, a domain error such as ``TURN_IN_PROGRESS``), and
    ``unexpected`` for anything else (an error the store does not translate: a bug, or a
    schema that does not fit)."""
    if isinstance(error, StoreUnavailable):
        pool_timeout = isinstance(error.__cause__, PoolTimeout | sa_exc.TimeoutError)
        return "pool_timeout" if pool_timeout else "unavailable"
    if isinstance(error, StoreConflict | PlannerError):
        return None
    return "unexpected"


class UnitsOfWork:
    """The tasks that run a store's units of work (one per store or per database).

    ``run`` never lets the caller's cancellation into the unit of work; ``drain`` waits
    for those in flight. Units still running when ``drain`` gives up are cancelled then,
    once, and awaited: a single cancellation lets them roll back and give their
    connection back; the pools close next. A read (``run(..., read=True)``) whose caller
    left is cancelled once after ``abandoned_read_grace_s`` seconds (see the module
    docstring); ``abandoned_reads_cancelled`` counts those.
    """

    def __init__(
        self,
        tracer: Tracer = tracing.NULL_TRACER,
        *,
        abandoned_read_grace_s: float = ABANDONED_READ_GRACE_S,
        unit_timeout_s: float | None = None,
    ) -> None:
        self._running: set[asyncio.Task[Any]] = set()
        self._unit_timeout_s = unit_timeout_s if unit_timeout_s and unit_timeout_s > 0 else None
        #: Units of work cancelled at their deadline (``unit_timeout_s``).
        self.units_expired = 0
        self._tracer = tracer
        self._on_failure: Callable[[str], object] | None = None
        self._read_grace_s = max(0.0, abandoned_read_grace_s)
        self.abandoned_reads_cancelled = 0
        # Reads cancelled once already: ``drain`` does not cancel them a second time.
        self._cancelled: set[asyncio.Task[Any]] = set()

    def on_failure(self, callback: Callable[[str], object]) -> None:
        """Call ``callback(kind)`` (``FAILURE_KINDS``) for every unit of work that fails
        from now on, whether or not its caller still waits (the database error metric)."""
        self._on_failure = callback

    @property
    def in_flight(self) -> int:
        """Units of work running now."""
        return len(self._running)

    async def run(self, work: Coroutine[Any, Any, T], name: str = "", *, read: bool = False) -> T:
        """Run ``work`` in a task owned here and return its result (or raise its error).

        A caller cancelled while it waits gets ``CancelledError`` at once; ``work`` goes
        on to its end, or, when it is a ``read``, for at most ``abandoned_read_grace_s``
        seconds more. ``name`` (the store method's) names its span. Past the deadline
        (``unit_timeout_s``) raises ``StoreUnavailable``, whatever ``work`` is waiting
        for, and cancels it once.
        """
        if name and self._tracer.current() is not None:
            work = _traced(self._tracer, name, work)
        loop = asyncio.get_running_loop()
        # The caller waits on ``outcome``, which the unit's task settles as its last step
        # (decision 0398): the caller goes on in the next pass of the event loop, and its
        # cancellation cancels only ``outcome``, never the task.
        outcome: asyncio.Future[T] = loop.create_future()
        task = loop.create_task(_settling(work, outcome))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        # Its error reaches the caller through ``outcome``; the task's own is read here.
        task.add_done_callback(_retrieved)
        if self._on_failure is not None:
            task.add_done_callback(self._report_failure)
        deadline = self._unit_timeout_s
        if deadline is not None:
            expiry = loop.call_later(deadline, self._expired, task, outcome, name)
            task.add_done_callback(lambda _: expiry.cancel())
        try:
            return await outcome
        except asyncio.CancelledError:
            if outcome.cancelled() and task.cancelled() and not _cancelling():
                # The unit was cancelled (``drain``) before it settled its outcome.
                raise StoreUnavailable("the store is closing") from None
            # Nobody will read the outcome: report a failure that is a bug, and retrieve
            # the rest, so nothing is logged as "never retrieved".
            task.add_done_callback(_report_abandoned)
            if read and not task.done():
                self._cancel_later(task)
            raise

    def _expired(self, task: asyncio.Task[Any], outcome: asyncio.Future[Any], name: str) -> None:
        """The deadline (``unit_timeout_s``) of a unit still running: its caller gets
        ``StoreUnavailable`` at once, and the unit is cancelled once."""
        if task.done():
            return
        # Cancelled first, so that the unit takes its cancellation before its caller
        # goes on.
        self._expire(task)
        if not outcome.done():
            deadline = self._unit_timeout_s
            outcome.set_exception(
                StoreUnavailable(
                    f"the database did not answer within {deadline:g} s "
                    f"(database.unit_timeout_s{f', {name}' if name else ''})"
                )
            )

    def _expire(self, task: asyncio.Task[Any]) -> None:
        # The deadline: cancelled once, never again (``drain`` skips it too).
        if task.done() or task in self._cancelled:
            return
        self.units_expired += 1
        self._cancelled.add(task)
        task.add_done_callback(self._cancelled.discard)
        if self._on_failure is not None:
            self._on_failure("unavailable")
        task.add_done_callback(_report_abandoned)
        task.cancel()

    def _cancel_later(self, task: asyncio.Task[Any]) -> None:
        def cancel() -> None:
            if not task.done() and task not in self._cancelled:
                self.abandoned_reads_cancelled += 1
                self._cancelled.add(task)
                task.add_done_callback(self._cancelled.discard)
                task.cancel()

        handle = asyncio.get_running_loop().call_later(self._read_grace_s, cancel)
        task.add_done_callback(lambda _: handle.cancel())

    def _report_failure(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or self._on_failure is None:
            return
        error = task.exception()
        kind = failure_kind(error) if error is not None else None
        if kind is not None:
            self._on_failure(kind)

    async def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for the units in flight; then cancel the rest
        and wait for them to give their connections back."""
        running = set(self._running)
        if not running:
            return
        _, pending = await asyncio.wait(running, timeout=max(0.0, timeout_s))
        if pending:
            log.warning("store: %d units of work still running at close; cancelled", len(pending))
            for task in pending - self._cancelled:
                task.cancel()
            await asyncio.wait(pending)


async def _traced(tracer: Tracer, name: str, work: Coroutine[Any, Any, T]) -> T:
    try:
        attributes = {tracing.STORE_OPERATION: name}
        with tracer.span(f"{tracing.STORE_SPAN}.{name}", attributes):
            return await work
    finally:
        # A task cancelled before its first step never starts ``work``: close it quietly.
        work.close()


class HasUnitsOfWork(Protocol):
    """A store whose methods are units of work: it owns a ``UnitsOfWork``."""

    units_of_work: UnitsOfWork


S = TypeVar("S", bound=HasUnitsOfWork)
C = TypeVar("C", bound=type)


def unit_of_work(
    method: Callable[Concatenate[S, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, T]]:
    """Make a store method a unit of work run by its store's ``UnitsOfWork``: the caller's
    cancellation never interrupts it (see the module docstring)."""

    read = bool(getattr(method, READ_MARK, False))

    @functools.wraps(method)
    async def run(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        work = method(self, *args, **kwargs)
        return await self.units_of_work.run(work, method.__name__, read=read)

    setattr(run, MARK, True)
    return run


def read_unit(
    method: Callable[Concatenate[S, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, T]]:
    """Mark a store method as a read: a unit of work that changes nothing, so it may be
    cancelled once its caller has left (see the module docstring). Put it below
    ``unit_of_work`` or on a method of a class marked ``@every_method_a_unit_of_work``."""
    setattr(method, READ_MARK, True)
    return method


def every_method_a_unit_of_work(cls: C) -> C:
    """Make every public coroutine method defined in ``cls`` a unit of work
    (``unit_of_work``); a subclass that defines or overrides one is marked again. A store
    method cannot be added without being one (a test also checks every store class)."""
    for name, value in list(vars(cls).items()):
        if name.startswith("_") or not inspect.iscoroutinefunction(value):
            continue
        if not getattr(value, MARK, False):
            setattr(cls, name, unit_of_work(value))
    return cls


async def _settling(work: Coroutine[Any, Any, T], outcome: asyncio.Future[T]) -> T:
    """Run ``work`` and settle ``outcome`` with what it returned or raised, unless
    ``outcome`` was settled or cancelled meanwhile (its deadline, a caller who left)."""
    try:
        value = await work
    except asyncio.CancelledError:
        if not outcome.done():
            outcome.cancel()
        raise
    except BaseException as error:
        if not outcome.done():
            outcome.set_exception(error)
            # Read here: the caller reads it too, unless it left.
            outcome.add_done_callback(_retrieved)
        raise
    if not outcome.done():
        outcome.set_result(value)
    return value


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Read ``future``'s error, so that asyncio does not report it as never retrieved."""
    if not future.cancelled():
        future.exception()


def _cancelling() -> bool:
    """Whether the current task is being cancelled (its own cancellation, not one of
    the futures it waits on)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _report_abandoned(task: asyncio.Task[Any]) -> None:
    if task.cancelled():
        return
    error = task.exception()
    if error is not None and not isinstance(error, _EXPECTED):
        log.error("store: a unit of work whose caller left failed", exc_info=error)
