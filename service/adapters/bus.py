"""Cross-replica signals: the receiving side of PostgreSQL LISTEN/NOTIFY
(docs/spec/api-and-streams.md).

``SqlSessionStore`` sends, in the transactions that store the events (delivered only if
they commit):

- ``ballet_planner_events``: ``'<session_id> <last_sequence> <replica_id>'`` after events
  were stored, ``'<session_id> -1 <replica_id>'`` after the session was deleted;
- ``ballet_planner_cancel``: ``'<turn_id>'`` after a cancel was requested.

``PgNotifier`` holds ONE dedicated connection per process, in autocommit, listening on
both channels, and passes what other replicas sent to the callbacks (its own events are
skipped: the replica that stored them has already published them in-process; cancels
are passed whichever replica sent them, the receiver's handling is idempotent). An idle
process costs nothing: no poll, no timer, one blocked read on one socket. Events reach
other replicas within the 1 s of docs/spec/api-and-streams.md as long as the callbacks are quick.

When the connection drops (a database restart, a network failure), the notifier
reconnects with exponential backoff and jitter, and after each reconnect calls
``on_resync``: notifications sent while it was away are lost and it cannot know which
sessions they named, so the receiver re-reads every session it follows. TCP keepalives
find a silently dead peer in about a minute.

``NullNotifier`` is the SQLite variant: SQLite means a single process (docs/spec/operations.md), so
there is nobody to hear from.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
from collections.abc import Awaitable, Callable

import psycopg
from sqlalchemy.engine import make_url

from service.adapters.store.engine import connect_args, conninfo
from service.adapters.store.repository import CANCEL_CHANNEL, EVENTS_CHANNEL

log = logging.getLogger(__name__)

EventsCallback = Callable[[str, int], Awaitable[None] | None]
CancelCallback = Callable[[str], Awaitable[None] | None]
ResyncCallback = Callable[[], Awaitable[None] | None]


class PgNotifier:
    """Receives other replicas' notifications on one LISTEN connection (``Notifier`` port).

    ``url`` is the database URL (SQLAlchemy form, ``postgresql+psycopg://...``, or
    libpq's); ``replica_id`` is this process's, as given to ``SqlSessionStore``.
    Reconnect delays start at ``min_backoff_s`` and double up to ``max_backoff_s``
    seconds; ``connect_timeout_s`` bounds each attempt.
    """

    def __init__(
        self,
        url: str,
        replica_id: str,
        *,
        min_backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        connect_timeout_s: int = 5,
    ) -> None:
        if make_url(url).get_backend_name() != "postgresql":
            raise ValueError("PgNotifier needs a PostgreSQL URL")
        # Several hosts allowed: each reconnection finds the primary (a failover).
        self._conninfo = conninfo(url)
        self._replica_id = replica_id
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._connect_timeout_s = connect_timeout_s
        self._task: asyncio.Task[None] | None = None
        self._listening = False
        self._on_events: EventsCallback | None = None
        self._on_cancel: CancelCallback | None = None
        self._on_resync: ResyncCallback | None = None

    @property
    def listening(self) -> bool:
        """Whether the LISTEN connection is up right now."""
        return self._listening

    async def start(
        self,
        on_events: EventsCallback,
        on_cancel: CancelCallback,
        on_resync: ResyncCallback | None = None,
    ) -> None:
        """Connect, LISTEN, and deliver notifications until ``stop``.

        ``on_events(session_id, last_sequence)`` (``last_sequence`` -1: deleted) and
        ``on_cancel(turn_id)`` may be plain functions or coroutines; they run one at a
        time on the listener's task, so they must be quick (hand longer work to a task).
        Returns once the first connection attempt has finished: on success the notifier
        is listening; on failure it logs a warning and keeps retrying in the background,
        and calls ``on_resync`` when it gets through. Raises ``RuntimeError`` if started
        twice.
        """
        if self._task is not None:
            raise RuntimeError("the notifier is already started")
        self._on_events, self._on_cancel, self._on_resync = on_events, on_cancel, on_resync
        first_attempt: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(first_attempt), name="pg-notifier")
        if not await first_attempt:
            log.warning("notifier: database unreachable at start; retrying in the background")

    async def stop(self) -> None:
        """Stop listening and close the connection; idempotent."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    # ------------------------------------------------------------------ the listener

    async def _run(self, first_attempt: asyncio.Future[bool]) -> None:
        delay = self._min_backoff_s
        resync_on_connect = False
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self._conninfo,
                    autocommit=True,
                    **connect_args(
                        connect_timeout_s=self._connect_timeout_s,
                        application_name="ballet-planner-notifier",
                    ),
                )
            except (psycopg.Error, OSError) as exc:
                log.debug("notifier: connect failed: %s", exc)
                if not first_attempt.done():
                    first_attempt.set_result(False)
                resync_on_connect = True
            else:
                delay = self._min_backoff_s
                try:
                    await self._listen(conn, first_attempt, resync_on_connect)
                except (psycopg.Error, OSError) as exc:
                    log.warning("notifier: connection lost, reconnecting: %s", exc)
                finally:
                    self._listening = False
                    with contextlib.suppress(psycopg.Error, OSError):
                        await conn.close()
                if not first_attempt.done():
                    first_attempt.set_result(False)
                resync_on_connect = True
            # Jitter keeps the replicas from reconnecting in lockstep after a restart.
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self._max_backoff_s)

    async def _listen(
        self,
        conn: psycopg.AsyncConnection[tuple[object, ...]],
        first_attempt: asyncio.Future[bool],
        resync: bool,
    ) -> None:
        await conn.execute(f"LISTEN {EVENTS_CHANNEL}")
        await conn.execute(f"LISTEN {CANCEL_CHANNEL}")
        self._listening = True
        log.info("notifier: listening")
        if not first_attempt.done():
            first_attempt.set_result(True)
        if resync and self._on_resync is not None:
            await self._call(self._on_resync)
        # Notifications that arrived between LISTEN and here wait in psycopg's backlog.
        async for notify in conn.notifies():
            await self._dispatch(notify.channel, notify.payload)

    async def _dispatch(self, channel: str, payload: str) -> None:
        if channel == CANCEL_CHANNEL:
            if self._on_cancel is not None and payload:
                await self._call(self._on_cancel, payload)
            return
        if channel != EVENTS_CHANNEL:
            return
        parts = payload.split(" ", 2)
        if len(parts) != 3 or not parts[1].lstrip("-").isdigit():
            log.warning("notifier: malformed events payload %r", payload)
            return
        session_id, sequence, replica_id = parts
        if replica_id == self._replica_id or self._on_events is None:
            return
        await self._call(self._on_events, session_id, int(sequence))

    @staticmethod
    async def _call(callback: Callable[..., Awaitable[None] | None], *args: object) -> None:
        # A failing receiver must not take the listener down with it: log and go on.
        try:
            result = callback(*args)
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("notifier: a callback failed")


class NullNotifier:
    """The ``Notifier`` of a single process (SQLite): there are no other replicas."""

    async def start(
        self,
        on_events: EventsCallback,
        on_cancel: CancelCallback,
        on_resync: ResyncCallback | None = None,
    ) -> None:
        """Deliver nothing: every event and cancel is local and published in-process."""

    async def stop(self) -> None:
        """Nothing to stop."""
