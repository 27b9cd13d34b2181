"""Cross-replica signals, sent after the commit they announce (decision 0230).

PostgreSQL serializes the commits of every transaction that carries a ``NOTIFY`` across
the whole cluster, WAL flush included, under one lock; a ``NOTIFY`` commit that stalls
anywhere (a synchronous standby that lags) stops every other one. So no unit of work of
the store notifies in its own transaction. Once it has committed, it hands its signal to
``Signals``, which returns at once; one task per store sends what is pending in one
short autocommit statement of its own, off the turn's path. A store hands on the signal
of a commit of events only when another replica follows the session (its commit read
``session_follows`` in the same round trip, decision 0340): a single replica sends none.

- events of a session: ``'<last_sequence> <replica_id>'`` on the session's channel
  (``session_channel``), ``last_sequence`` -1 when the session was deleted;
- a cancel request: ``'<turn_id>'`` on ``CANCEL_CHANNEL``, which every replica hears.

A signal is a hint, not the delivery: a replica following a session also reads the
session's stored sequence every second (``service.adapters.bus``), so a signal that is
lost (the process ended before sending it), late (``NOTIFY`` stalled) or dropped (over
``max_pending``) delays events by about a second at most. Hence the bounds: pending
signals are merged per session (only the newest sequence matters) and per turn, at most
``max_pending`` of them, the rest dropped; each send waits at most ``lock_timeout_s`` for
the cluster's notify lock, then fails, is logged and counted, and the next one follows
after ``retry_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence

log = logging.getLogger(__name__)

#: The channel prefix of a session's events notifications.
SESSION_CHANNEL_PREFIX = "bp_s_"
#: The channel of cancel requests, heard by every replica.
CANCEL_CHANNEL = "ballet_planner_cancel"
#: The ``last_sequence`` of an events notification that says the session was deleted.
DELETED_SEQUENCE = -1
#: PostgreSQL's identifier limit (NAMEDATALEN - 1), in bytes.
IDENTIFIER_MAX_BYTES = 63

#: Pending signals kept while the sender is busy or failing; more are dropped.
MAX_PENDING = 10_000
#: Signals sent in one statement.
SEND_BATCH = 200
#: The longest a send waits for the cluster's notify lock, in seconds.
LOCK_TIMEOUT_S = 2.0
#: The pause after a failed send before the next, in seconds.
RETRY_S = 0.5

#: What ``Signals`` reports per signal: sent, failed (the send raised) or dropped.
OUTCOMES = ("sent", "failed", "dropped")

#: Sends ``(channel, payload)`` pairs in one autocommit statement that waits at most
#: ``lock_timeout_s`` seconds for locks; raises what the database raised.
RunStatement = Callable[[Sequence[tuple[str, str]], float], Awaitable[None]]


def session_channel(session_id: str) -> str:
    """The notification channel of a session's events: ``bp_s_<session_id>``, or, for an
    id too long for a PostgreSQL identifier, ``bp_s_`` and 40 hex digits of its SHA-256
    (two sessions may then share a channel: a receiver reads both, harmlessly)."""
    channel = SESSION_CHANNEL_PREFIX + session_id
    if len(channel.encode()) <= IDENTIFIER_MAX_BYTES:
        return channel
    return SESSION_CHANNEL_PREFIX + hashlib.sha256(session_id.encode()).hexdigest()[:40]


def notify_sql(count: int, placeholder: str = "%s") -> str:
    """``SELECT set_config('lock_timeout', ...), pg_notify(c, p), ...`` for ``count``
    notifications, with ``placeholder`` for each parameter (the lock timeout first, then
    channel and payload pairs): one implicit transaction, whose commit waits for the notify
    lock at most the lock timeout."""
    notifies = ", ".join(f"pg_notify({placeholder}, {placeholder})" for _ in range(count))
    return f"SELECT set_config('lock_timeout', {placeholder}, true), {notifies}"


def notify_params(signals: Sequence[tuple[str, str]], lock_timeout_s: float) -> list[str]:
    """The parameters of ``notify_sql`` for ``signals``."""
    params = [f"{max(1, round(lock_timeout_s * 1000))}ms"]
    for channel, payload in signals:
        params += [channel, payload]
    return params


class Signals:
    """The sending side of the cross-replica signals of one store (see the module
    docstring). ``send`` runs one statement (``RunStatement``); ``replica_id`` names this process
    in events payloads, so its own listener skips them. Methods never wait and never
    raise for the database: call them after the commit."""

    def __init__(
        self,
        send: RunStatement,
        replica_id: str,
        *,
        max_pending: int = MAX_PENDING,
        lock_timeout_s: float = LOCK_TIMEOUT_S,
        retry_s: float = RETRY_S,
    ) -> None:
        self._send = send
        self._replica_id = replica_id
        self._max_pending = max_pending
        self._lock_timeout_s = lock_timeout_s
        self._retry_s = retry_s
        # Session id -> newest sequence (DELETED_SEQUENCE wins); turn ids to cancel.
        self._events: dict[str, int] = {}
        self._cancels: dict[str, None] = {}
        self._task: asyncio.Task[None] | None = None
        self._watchers: list[Callable[[str, int], object]] = []

    def watch(self, callback: Callable[[str, int], object]) -> None:
        """Call ``callback(outcome, count)`` for signals sent, failed or dropped
        (``OUTCOMES``), e.g. to count them in a metric."""
        self._watchers.append(callback)

    @property
    def pending(self) -> int:
        """Signals waiting to be sent."""
        return len(self._events) + len(self._cancels)

    def events(self, session_id: str, last_sequence: int) -> None:
        """Announce that ``session_id``'s events up to ``last_sequence`` are stored
        (``DELETED_SEQUENCE``: the session was deleted)."""
        known = self._events.get(session_id)
        if known is None:
            if not self._room():
                return
            self._events[session_id] = last_sequence
        elif known != DELETED_SEQUENCE and (
            last_sequence == DELETED_SEQUENCE or last_sequence > known
        ):
            self._events[session_id] = last_sequence
        self._kick()

    def cancel(self, turn_id: str) -> None:
        """Announce that a cancel of ``turn_id`` was requested."""
        if turn_id not in self._cancels:
            if not self._room():
                return
            self._cancels[turn_id] = None
        self._kick()

    async def flush(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for what is pending to be sent (or fail)."""
        task = self._task
        if task is not None and not task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), timeout_s)

    async def close(self) -> None:
        """Stop sending; what is still pending is dropped (and counted)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._report("dropped", self.pending)
        self._events.clear()
        self._cancels.clear()

    def _room(self) -> bool:
        if self.pending < self._max_pending:
            return True
        self._report("dropped", 1)
        return False

    def _kick(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._drain(), name="planner-signals"
            )

    def _take(self) -> list[tuple[str, str]]:
        batch: list[tuple[str, str]] = []
        while self._cancels and len(batch) < SEND_BATCH:
            turn_id = next(iter(self._cancels))
            del self._cancels[turn_id]
            batch.append((CANCEL_CHANNEL, turn_id))
        while self._events and len(batch) < SEND_BATCH:
            session_id = next(iter(self._events))
            sequence = self._events.pop(session_id)
            batch.append((session_channel(session_id), f"{sequence} {self._replica_id}"))
        return batch

    async def _drain(self) -> None:
        while self.pending:
            batch = self._take()
            try:
                await self._send(batch, self._lock_timeout_s)
            except asyncio.CancelledError:
                self._report("dropped", len(batch))
                raise
            except Exception as error:
                # Followers heal by sequence within a second: nothing is lost but time.
                log.warning("signals: %d notifications not sent: %s", len(batch), error)
                self._report("failed", len(batch))
                await asyncio.sleep(self._retry_s)
            else:
                self._report("sent", len(batch))

    def _report(self, outcome: str, count: int) -> None:
        if not count:
            return
        for watcher in self._watchers:
            try:
                watcher(outcome, count)
            except Exception:
                log.exception("signals: a watcher failed")
