"""Cross-replica signals: the receiving side of PostgreSQL LISTEN/NOTIFY, healed by
sequence (docs/spec/api-and-streams.md; decisions 0230-0232).

The stores send, after their commits (``service.adapters.store.signals``):

- on a session's channel (``session_channel``: ``bp_s_<session_id>``):
  ``'<last_sequence> <replica_id>'`` after events were stored, ``'-1 <replica_id>'``
  after the session was deleted;
- on ``ballet_planner_cancel``: ``'<turn_id>'`` after a cancel was requested.

``PgNotifier`` holds ONE dedicated connection per process, in autocommit. It listens on
the cancel channel, and on the channel of each session this process follows (a Chat
stream here is attached to it): ``LISTEN`` when the hub's first stream of the session
attaches, ``UNLISTEN`` when its last leaves, so the notifications a replica handles are
those of the sessions it serves. In the same statement it records what it follows as its
rows of ``session_follows``, so that other replicas' commits signal only sessions some
replica follows (decision 0340). What other replicas sent is passed to the callbacks (its
own events are skipped: the replica that stored them has already published them
in-process; cancels are passed whichever replica sent them, the receiver's handling is
idempotent).

Notifications are hints. While it follows any session, the notifier also reads, once
per ``heal_interval_s`` (1 s) and in one indexed statement on the same connection, the
stored ``last_sequence`` of every followed session, and passes each to ``on_events``
(the hub reads the events of a session only when a stream of it is behind): a
notification that was lost, or that a stalled ``NOTIFY`` elsewhere in the cluster holds
back, is healed within about a second (the 1 s of docs/spec/api-and-streams.md). A
process that follows nothing reads nothing; it wakes every ``wait_s`` (0.1 s) to apply
new follows, in memory.

When the connection drops (a database restart, a network failure), the notifier
reconnects with exponential backoff and jitter, listens again on what it follows, and
calls ``on_resync``: the receiver re-reads every session it follows. TCP keepalives find
a silently dead peer in about a minute.

``NullNotifier`` is the SQLite variant: SQLite means a single process (docs/spec/operations.md), so
there is nobody to hear from.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from service.adapters.store.engine import SOCKET_BOUNDS, SocketBounds, connect_args, conninfo
from service.adapters.store.signals import CANCEL_CHANNEL, DELETED_SEQUENCE, session_channel

log = logging.getLogger(__name__)

EventsCallback = Callable[[str, int], Awaitable[None] | None]
CancelCallback = Callable[[str], Awaitable[None] | None]
ResyncCallback = Callable[[], Awaitable[None] | None]

#: What ``PgNotifier.watch`` reports: notifications handled (events, cancel), and
#: sessions a heal read found ahead of every notification (healed).
COUNTS = ("events", "cancel", "healed")

#: Seconds between heal reads while the notifier follows any session.
HEAL_INTERVAL_S = 1.0
#: The longest a new follow waits to be listened to, in seconds.
WAIT_S = 0.1

# The heal read sends the followed ids and the sequence last known of each as two text
# parameters (adapting Python lists of 10,000 items to arrays costs more than the read),
# and gets back only the sessions whose stored sequence moved, or that are gone: at
# 10,000 followed sessions the answer is the few that changed, not 10,000 rows. Session
# ids are UUIDs; with ids holding a comma (none the planner makes) every row is read.
_MOVED_SEQUENCES = (
    "SELECT k.id, coalesce(s.last_sequence, -1) "
    "FROM unnest(string_to_array(%s, ','), string_to_array(%s, ',')::bigint[]) AS k(id, seq) "
    "LEFT JOIN sessions s ON s.session_id = k.id "
    "WHERE s.session_id IS NULL OR s.last_sequence <> k.seq"
)
_LAST_SEQUENCES_OF_ANY_IDS = (
    "SELECT session_id, last_sequence FROM sessions WHERE session_id = ANY(%s)"
)
# The rows of ``session_follows`` (decision 0340), composed into the statement that
# listens; session ids are joined with newlines (the planner's ids hold none; one that
# does is recorded as its parts, which only costs its commits their signal: healed).
_RECORD = sql.SQL(
    "INSERT INTO session_follows (session_id, replica_id) "
    "SELECT unnest(string_to_array({sessions}, E'\\n')), {replica} ON CONFLICT DO NOTHING"
)
_FORGET = sql.SQL(
    "DELETE FROM session_follows WHERE replica_id = {replica} "
    "AND session_id = ANY(string_to_array({sessions}, E'\\n'))"
)
_FORGET_ALL = sql.SQL("DELETE FROM session_follows WHERE replica_id = {replica}")
#: The sequence sent for a session not read yet: never a stored one, so it is read.
_UNKNOWN = -2
#: Every this many heals, every followed session is passed on with its known sequence,
#: changed or not (a fill that failed is retried); in between, only those that moved.
_FULL_HEAL_EVERY = 10


class PgNotifier:
    """Receives other replicas' notifications on one LISTEN connection (``Notifier`` port).

    ``url`` is the database URL (SQLAlchemy form, ``postgresql+psycopg://...``, or
    libpq's); ``replica_id`` is this process's, as given to ``SqlSessionStore``.
    ``heal_interval_s`` is the period of the heal read while any session is followed;
    new follows are listened to within ``wait_s`` seconds. Reconnect delays start at
    ``min_backoff_s`` and double up to ``max_backoff_s`` seconds; ``connect_timeout_s``
    bounds each attempt; ``bounds`` are the connection's socket bounds (keepalives and
    the TCP user timeout: a silent database ends the LISTEN connection, decision 0310).
    """

    def __init__(
        self,
        url: str,
        replica_id: str,
        *,
        heal_interval_s: float = HEAL_INTERVAL_S,
        wait_s: float = WAIT_S,
        min_backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        connect_timeout_s: int = 5,
        bounds: SocketBounds = SOCKET_BOUNDS,
    ) -> None:
        if make_url(url).get_backend_name() != "postgresql":
            raise ValueError("PgNotifier needs a PostgreSQL URL")
        if heal_interval_s <= 0 or wait_s <= 0:
            raise ValueError("heal_interval_s and wait_s must be positive")
        # Several hosts allowed: each reconnection finds the primary (a failover).
        self._conninfo = conninfo(url)
        self._replica_id = replica_id
        self._heal_interval_s = heal_interval_s
        self._wait_s = wait_s
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._connect_timeout_s = connect_timeout_s
        self._bounds = bounds
        self._task: asyncio.Task[None] | None = None
        self._listening = False
        self._on_events: EventsCallback | None = None
        self._on_cancel: CancelCallback | None = None
        self._on_resync: ResyncCallback | None = None
        # Followed sessions, their channels, and the newest sequence heard of each.
        self._followed: set[str] = set()
        self._channels: dict[str, set[str]] = {}
        self._known: dict[str, int] = {}
        self._listened: set[str] = set()
        # The sessions recorded in ``session_follows`` (None: not known on this
        # connection, so its rows are all written afresh).
        self._recorded: set[str] | None = None
        # Follows changed since the channels listened to were last applied.
        self._follows_changed = False
        self._heals = 0
        self._watchers: list[Callable[[str, int], object]] = []
        #: Totals of ``COUNTS`` since the start.
        self.counts: dict[str, int] = dict.fromkeys(COUNTS, 0)

    @property
    def listening(self) -> bool:
        """Whether the LISTEN connection is up right now."""
        return self._listening

    @property
    def listened(self) -> frozenset[str]:
        """The session channels listened to on the connection right now."""
        return frozenset(self._listened)

    @property
    def followed(self) -> frozenset[str]:
        """The sessions followed now."""
        return frozenset(self._followed)

    def watch(self, callback: Callable[[str, int], object]) -> None:
        """Call ``callback(count, n)`` as ``COUNTS`` grow, e.g. to count them in a metric."""
        self._watchers.append(callback)

    def follow(self, session_id: str) -> None:
        """Hear ``session_id``'s events from now on (listened to within ``wait_s``, and
        healed by sequence); idempotent."""
        if session_id in self._followed:
            return
        self._followed.add(session_id)
        self._channels.setdefault(session_channel(session_id), set()).add(session_id)
        self._follows_changed = True

    def unfollow(self, session_id: str) -> None:
        """Stop hearing ``session_id``'s events; idempotent."""
        if session_id not in self._followed:
            return
        self._followed.discard(session_id)
        self._known.pop(session_id, None)
        channel = session_channel(session_id)
        sessions = self._channels.get(channel)
        if sessions is not None:
            sessions.discard(session_id)
            if not sessions:
                del self._channels[channel]
        self._follows_changed = True  # its row of session_follows goes

    async def start(
        self,
        on_events: EventsCallback,
        on_cancel: CancelCallback,
        on_resync: ResyncCallback | None = None,
    ) -> None:
        """Connect, LISTEN, and deliver notifications and heals until ``stop``.

        ``on_events(session_id, last_sequence)`` (``last_sequence`` -1: deleted) and
        ``on_cancel(turn_id)`` may be plain functions or coroutines; they run one at a
        time on the listener's task, so they must be quick (hand longer work to a task).
        ``on_events`` is called for notifications of followed sessions and, once per
        heal interval, for every followed session with its stored last sequence.
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
                        bounds=self._bounds,
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
        self._listened = set()
        self._recorded = None
        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(CANCEL_CHANNEL)))
        self._follows_changed = True
        self._heals = -1  # the first heal on a new connection passes everything on
        await self._apply_follows(conn)
        self._listening = True
        log.info("notifier: listening")
        if not first_attempt.done():
            first_attempt.set_result(True)
        if resync and self._on_resync is not None:
            await self._call(self._on_resync)
        next_heal = time.monotonic()
        while True:
            await self._apply_follows(conn)
            if self._followed and time.monotonic() >= next_heal:
                next_heal = time.monotonic() + self._heal_interval_s
                await self._heal(conn)
            # Notifications that arrived meanwhile wait in psycopg's backlog.
            async for notify in conn.notifies(timeout=self._wait_s):
                await self._dispatch(notify.channel, notify.payload)

    async def _apply_follows(self, conn: psycopg.AsyncConnection[tuple[object, ...]]) -> None:
        """LISTEN to the channels of new follows and UNLISTEN the rest, and record the
        sessions followed in ``session_follows`` (decision 0340), in one statement and
        one transaction (nothing to do, and no work, while the follows are unchanged).
        After a (re)connection every row of this replica is written afresh."""
        if not self._follows_changed:
            return
        self._follows_changed = False
        wanted = set(self._channels)
        statements = [
            sql.SQL("LISTEN {}").format(sql.Identifier(c)) for c in wanted - self._listened
        ]
        statements += [
            sql.SQL("UNLISTEN {}").format(sql.Identifier(c)) for c in self._listened - wanted
        ]
        replica = sql.Literal(self._replica_id)
        if self._recorded is None:
            statements.append(_FORGET_ALL.format(replica=replica))
            recorded: set[str] = set()
        else:
            recorded = self._recorded
        added = sorted(self._followed - recorded)
        removed = sorted(recorded - self._followed)
        if added:
            statements.append(
                _RECORD.format(sessions=sql.Literal("\n".join(added)), replica=replica)
            )
        if removed:
            statements.append(
                _FORGET.format(sessions=sql.Literal("\n".join(removed)), replica=replica)
            )
        if statements:
            await conn.execute(sql.SQL("; ").join(statements))
        self._listened = wanted
        self._recorded = set(self._followed)

    async def _heal(self, conn: psycopg.AsyncConnection[tuple[object, ...]]) -> None:
        """Pass every followed session's stored last sequence to ``on_events`` (-1 for a
        session that is gone): one indexed read for all of them."""
        followed = list(self._followed)
        if any("," in session_id for session_id in followed):
            cursor = await conn.execute(_LAST_SEQUENCES_OF_ANY_IDS, (followed,))
            rows = await cursor.fetchall()
            stored = {str(row[0]): int(str(row[1])) for row in rows}
            moved = {s: stored.get(s, DELETED_SEQUENCE) for s in followed}
        else:
            known_text = ",".join(str(self._known.get(s, _UNKNOWN)) for s in followed)
            cursor = await conn.execute(_MOVED_SEQUENCES, (",".join(followed), known_text))
            moved = {str(row[0]): int(str(row[1])) for row in await cursor.fetchall()}
        self._heals += 1
        healed = 0
        for session_id, sequence in moved.items():
            if session_id not in self._followed or self._on_events is None:
                continue
            known = self._known.get(session_id)
            if known == sequence:
                continue  # a session gone for a while: said already
            if known is not None and (sequence > known or sequence == DELETED_SEQUENCE):
                healed += 1
            self._known[session_id] = sequence
            await self._call(self._on_events, session_id, sequence)
        if self._heals % _FULL_HEAL_EVERY == 0 and self._on_events is not None:
            for session_id in followed:
                known = self._known.get(session_id)
                if known is not None and session_id in self._followed and session_id not in moved:
                    await self._call(self._on_events, session_id, known)
        self._count("healed", healed)

    async def _dispatch(self, channel: str, payload: str) -> None:
        if channel == CANCEL_CHANNEL:
            self._count("cancel", 1)
            if self._on_cancel is not None and payload:
                await self._call(self._on_cancel, payload)
            return
        sessions = self._channels.get(channel)
        if not sessions:
            return  # a channel unfollowed since
        self._count("events", 1)
        parts = payload.split(" ", 1)
        if len(parts) != 2 or not parts[0].lstrip("-").isdigit():
            log.warning("notifier: malformed events payload %r", payload)
            return
        sequence, replica_id = int(parts[0]), parts[1]
        for session_id in tuple(sessions):
            known = self._known.get(session_id)
            if known is None or sequence == DELETED_SEQUENCE or sequence > known:
                self._known[session_id] = sequence
            if replica_id != self._replica_id and self._on_events is not None:
                await self._call(self._on_events, session_id, sequence)

    def _count(self, name: str, n: int) -> None:
        if not n:
            return
        self.counts[name] += n
        for watcher in self._watchers:
            try:
                watcher(name, n)
            except Exception:
                log.exception("notifier: a watcher failed")

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

    def follow(self, session_id: str) -> None:
        """Nothing to listen to."""

    def unfollow(self, session_id: str) -> None:
        """Nothing to stop listening to."""

    async def stop(self) -> None:
        """Nothing to stop."""
