"""The store's hot path on PostgreSQL: plain SQL through psycopg (decision 0113).

A turn's units of work (open the turn, commit its events), a Chat stream's (read the
session, take and release a stream slot, read the events it replays or catches up on)
and a session's creation run here (decision 0227 added the last two): one statement and
one round trip each, on an autocommit psycopg connection from this module's pool,
calling the server-side functions of migration 0005 or a single statement. Everything
else of the store stays on SQLAlchemy (``repository.py``), where its statements are rare
enough that building them costs nothing that matters, and on SQLite the whole store is
SQLAlchemy.

Errors are translated here, in one place, like ``errors.translated`` does for
SQLAlchemy: the database unreachable, a broken connection, no pooled connection in time
(``StoreUnavailable``); a failed unit-of-work condition, SQLSTATE ``BP409``
(``StoreConflict``); the unique keys (``TURN_IN_PROGRESS``, ``RequestIdTaken``); a NUL
character (``InvalidArgument``/``NUL_CHARACTER``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime
from typing import Any, cast

import orjson
import psycopg
from psycopg import errors as pg_errors
from psycopg import generators, pq
from psycopg.pq.abc import PGresult
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.ext.asyncio import AsyncEngine

from service.adapters.store import codec
from service.adapters.store import turn_units as units
from service.adapters.store.engine import SOCKET_BOUNDS, SocketBounds, connect_args, conninfo
from service.adapters.store.errors import RequestIdTaken
from service.adapters.store.repository import CONTEXT_CACHE_BYTES, SqlSessionStore
from service.adapters.store.signals import Signals, notify_params, notify_sql
from service.adapters.store.streams import SqlStreamStore
from service.adapters.store.tables import (
    UQ_ONE_RUNNING_TURN,
    UQ_SESSION_REQUEST_ID,
    UQ_TURN_REQUEST_ID,
    sessions,
)
from service.adapters.store.work import UnitsOfWork, every_method_a_unit_of_work, read_unit
from service.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    StoreConflict,
    StoreUnavailable,
)
from service.core.model import (
    EventKind,
    Session,
    SessionEvent,
    Turn,
    TurnStartedData,
    copied,
)
from service.core.ports import (
    ContextSnapshot,
    LeaseStatus,
    OpenStream,
    Promoted,
    Promotion,
    StartOutcomeKind,
    TurnCommit,
    TurnStart,
    TurnStartOutcome,
)

log = logging.getLogger(__name__)

#: Called after each hot-path statement with its text and the rows it returned or changed:
#: what SQLAlchemy's ``after_cursor_execute`` event is for the rest of the store.
StatementObserver = Callable[[str, int], None]

#: The SQLSTATE the functions of migration 0005 raise when a condition fails.
CONFLICT_SQLSTATE = "BP409"

_SESSION = """
SELECT s.*, (SELECT t.turn_id FROM turns t
             WHERE t.session_id = s.session_id AND t.state = 'running') AS running_turn_id
FROM sessions s WHERE s.session_id = %s
"""
_CONTEXT_MESSAGES = """
SELECT * FROM messages WHERE session_id = %s AND sequence > %s ORDER BY sequence
"""
# A stream's replay and catch-up: the statement of ``SqlSessionStore.events_after``,
# compiled once for psycopg (named parameters; the dialect class carries no annotations).
_PSYCOPG: Any = PGDialect_psycopg
_EVENTS_AFTER = str(units.EVENTS_AFTER.compile(dialect=_PSYCOPG()))
_SESSION_COLUMNS = frozenset(c.name for c in sessions.c)


@functools.lru_cache(maxsize=4)
def _insert_session_sql(columns: tuple[str, ...]) -> str:
    unknown = set(columns) - _SESSION_COLUMNS
    if unknown:
        raise ValueError(f"not columns of sessions: {sorted(unknown)}")
    return (
        f"INSERT INTO sessions ({', '.join(columns)}) VALUES ({', '.join(['%s'] * len(columns))})"
    )


# Whether another replica follows the session (decision 0340): read in the statement of
# the commit, so that a commit nobody else follows sends no signal and costs no round trip.
_FOLLOWED_ELSEWHERE = (
    "EXISTS (SELECT 1 FROM session_follows WHERE session_id = %s AND replica_id <> %s)"
)
_RENEW_LEASE = """
UPDATE turns SET lease_expires_at = %s
WHERE turn_id = %s AND owner = %s AND state = 'running'
RETURNING cancel_requested, cancel_reason, join_pending
"""


def make_pool(
    url: str,
    *,
    max_size: int,
    timeout_s: float,
    connect_timeout_s: int = 5,
    pre_ping: bool = False,
    application_name: str = "ballet-planner",
    bounds: SocketBounds = SOCKET_BOUNDS,
) -> AsyncConnectionPool[Any]:
    """A closed pool of autocommit connections for the hot path (``open()`` it).

    ``url`` may name several hosts (``engine.conninfo``). ``max_size`` bounds its
    connections (decision 0113 gives the sizing rule); a unit of work that waits more
    than ``timeout_s`` seconds for one fails with ``StoreUnavailable``;
    ``connect_timeout_s`` bounds each host's connection attempt. ``pre_ping`` checks
    every connection at checkout (one round trip, ``database.pool_pre_ping``); ``bounds``
    are its sockets' (``SocketBounds``).
    """
    return AsyncConnectionPool(
        conninfo(url),
        min_size=1,
        max_size=max_size,
        timeout=timeout_s,
        open=False,
        name="ballet-planner-hot",
        check=AsyncConnectionPool.check_connection if pre_ping else None,
        kwargs=connect_args(
            connect_timeout_s=connect_timeout_s,
            application_name=application_name,
            bounds=bounds,
            autocommit=True,
        ),
    )


@dataclasses.dataclass
class _Reach:
    """Whether a pool's database was found unreachable (and the pool has had no
    connection free since): one per pool, shared by every ``PgHotPath`` on it."""

    unreachable: bool = False


_REACH: weakref.WeakKeyDictionary[AsyncConnectionPool[Any], _Reach] = weakref.WeakKeyDictionary()


class PgHotPath:
    """The hot units of work on ``pool`` (see the module docstring).

    Connections are not checked at checkout unless the pool was made with ``pre_ping``
    (that costs a round trip per unit of work): one that the server dropped fails its
    unit of work once and leaves the pool, and the pool then checks its idle connections
    in the background, so a database restart or failover fails one unit of work per
    pool, not one per pooled connection.
    Once the database could not be reached, and until the pool has a connection free
    again (it reconnects in the background, backing off), each unit of work opens a
    connection of its own: a database that is down is reported at once, and one that is
    back is used at once, whatever the pool's backoff (decision 0312: a first success
    does not send the next unit back to a pool that is still empty). Whether the
    database was found unreachable belongs to the pool, not to one hot path: the
    session store's and the stream store's share it (decision 0370), so a unit of work
    of either never waits on an emptied pool whose growth waits on its backoff.
    """

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        *,
        observers: list[StatementObserver] | None = None,
    ) -> None:
        self._pool = pool
        self._reach = _REACH.setdefault(pool, _Reach())
        self._observers = observers if observers is not None else []
        self._checking: asyncio.Task[None] | None = None

    async def _run(
        self,
        cursor: psycopg.AsyncCursor[Any],
        query: str,
        params: Sequence[Any] | Mapping[str, Any],
        *,
        prepare: bool | None = None,
    ) -> None:
        await cursor.execute(query, params, prepare=prepare)
        for observe in self._observers:
            observe(query, cursor.rowcount)

    @asynccontextmanager
    async def _conn(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        with translated_pg():
            if self._unreachable and not self._pool.get_stats().get("pool_available", 0):
                # make_pool gives the pool a plain string and dict (not callables).
                kwargs = cast(dict[str, Any], self._pool.kwargs)
                direct = await psycopg.AsyncConnection.connect(str(self._pool.conninfo), **kwargs)
                try:
                    yield direct
                finally:
                    await direct.close()
                # Still direct until the pool has a connection free: the pool reconnects
                # on its own backoff (up to 16 s between tries), the database is back now.
                return
            checked_out = False
            try:
                # getconn and putconn rather than the pool's ``connection()``: that one
                # also enters the connection's own context, whose commit at the end is
                # work for nothing on an autocommit connection (a third of a checkout's
                # CPU). putconn checks what the unit left: a connection still running a
                # statement or broken is closed, not pooled.
                conn = await self._pool.getconn()
                checked_out = True
                try:
                    yield conn
                finally:
                    await self._pool.putconn(conn)
            except (psycopg.OperationalError, PoolTimeout) as error:
                self._unreachable = True
                if isinstance(error, psycopg.OperationalError):
                    self._check_idle()
                raise
            finally:
                # A checkout ended by the unit's deadline (a cancellation, not a pool
                # error) also means the pool had nothing to give: without this, the unit
                # retried after the database's return waits for the pool's next reconnect.
                if not checked_out:
                    self._unreachable = True
            self._unreachable = False

    @property
    def _unreachable(self) -> bool:
        return self._reach.unreachable

    @_unreachable.setter
    def _unreachable(self, value: bool) -> None:
        self._reach.unreachable = value

    def _check_idle(self) -> None:
        # The idle connections of a server that went away are broken too: drop them now
        # rather than one failed unit of work at a time (as SQLAlchemy invalidates its
        # pool on a disconnect).
        if self._checking is None or self._checking.done():
            self._checking = asyncio.get_running_loop().create_task(
                self._pool.check(), name="hot-pool-check"
            )
            self._checking.add_done_callback(_retrieved)

    async def ping(self) -> None:
        """Check that the hot path's pool reaches the database (``SELECT 1``); a
        connection found broken is retried once on another (see the class docstring)."""
        for attempt in range(2):
            try:
                await self.one("SELECT 1", ())
                return
            except StoreUnavailable as error:
                if attempt or not isinstance(error.__cause__, psycopg.OperationalError):
                    raise

    async def one(self, query: str, params: Sequence[Any]) -> Mapping[str, Any] | None:
        """The first row of ``query`` as a mapping, or None."""
        async with self._conn() as conn:
            cursor = conn.cursor(row_factory=dict_row)
            await self._run(cursor, query, params)
            row: Mapping[str, Any] | None = await cursor.fetchone()
            return row

    async def rows(
        self, query: str, params: Sequence[Any] | Mapping[str, Any]
    ) -> list[Mapping[str, Any]]:
        """Every row of ``query`` as a mapping (a prepared statement)."""
        async with self._conn() as conn:
            cursor = conn.cursor(row_factory=dict_row)
            await self._run(cursor, query, params, prepare=True)
            return list(await cursor.fetchall())

    async def execute(self, query: str, params: Sequence[Any]) -> None:
        """Run ``query``, one autocommit statement (prepared)."""
        async with self._conn() as conn:
            await self._run(conn.cursor(), query, params, prepare=True)

    async def get_session(self, session_id: str) -> Session | None:
        row = await self.one(_SESSION, (session_id,))
        return None if row is None else codec.session_from_row(row)

    async def context(self, session_id: str) -> ContextSnapshot | None:
        """The session and its messages after the summary, on one connection."""
        async with self._conn() as conn:
            cursor = conn.cursor(row_factory=dict_row)
            await self._run(cursor, _SESSION, (session_id,))
            row = await cursor.fetchone()
            if row is None:
                return None
            session = codec.session_from_row(row)
            await self._run(cursor, _CONTEXT_MESSAGES, (session_id, session.summary_up_to))
            rows = await cursor.fetchall()
        return ContextSnapshot(session, [codec.message_from_row(r) for r in rows])

    async def call(self, function: str, argument: Mapping[str, Any]) -> Any:
        """``SELECT function(argument)`` with ``argument`` as ``jsonb``; its value."""
        async with self._conn() as conn:
            cursor = conn.cursor()
            await self._run(
                cursor, f"SELECT {function}(%s)", (Jsonb(argument, dumps=_dumps),), prepare=True
            )
            row = await cursor.fetchone()
            assert row is not None
            return row[0]

    async def call_followed(
        self, function: str, argument: Mapping[str, Any], session_id: str, replica_id: str
    ) -> tuple[Any, bool]:
        """``call``, and in the same statement whether a replica other than
        ``replica_id`` follows ``session_id`` (``session_follows``, decision 0340): the
        value and that flag, in one round trip.

        A turn's three units of work run here, on libpq's calls (decision 0393): the
        statement prepared once per connection under the function's name, the
        argument sent as JSON text, the value read back as ``jsonb`` (a mapping),
        ``bigint`` (an int) or text."""
        query = _FOLLOWED_CALLS.get(function)
        if query is None:
            query = _FOLLOWED_CALLS[function] = _FollowedCall(function)
        params = [_json(argument), session_id.encode(), replica_id.encode()]
        async with self._conn() as conn:
            result = await _run_prepared(conn, query.name, query.sql, params)
            for observe in self._observers:
                observe(query.text, result.ntuples)
            return _value(result, 0), result.get_value(0, 1) == b"t"

    async def renew_lease(self, turn_id: str, owner: str, until: datetime) -> LeaseStatus:
        """Extend a lease (``held`` false when the turn is not ``owner``'s running
        turn) and say whether, and why, a cancel was requested."""
        row = await self.one(_RENEW_LEASE, (until, turn_id, owner))
        if row is None:
            return LeaseStatus(held=False)
        return LeaseStatus(
            held=True,
            cancel_requested=bool(row["cancel_requested"]),
            cancel_reason=str(row["cancel_reason"]),
            join_pending=bool(row["join_pending"]),
        )

    async def notify(self, signals: Sequence[tuple[str, str]], lock_timeout_s: float) -> None:
        """Send ``(channel, payload)`` notifications in one autocommit statement, waiting
        at most ``lock_timeout_s`` seconds for the notify lock (``signals.RunStatement``). Not a
        unit of work's statement: the observers do not see it."""
        async with self._conn() as conn:
            await conn.execute(
                notify_sql(len(signals)), notify_params(signals, lock_timeout_s), prepare=False
            )

    async def close_streams(self, stream_ids: Sequence[str]) -> None:
        async with self._conn() as conn:
            await self._run(
                conn.cursor(),
                "DELETE FROM chat_streams WHERE stream_id = ANY(%s)",
                (list(stream_ids),),
            )

    def units(self, events: Sequence[SessionEvent]) -> dict[str, Any]:
        """The ``events`` and ``messages`` arguments of a function of migration 0005."""
        rows: list[dict[str, Any]] = []
        for index, event in enumerate(events):
            if event.message is not None:
                row = codec.message_row(event.message)
                del row["session_id"], row["sequence"]
                row["i"] = index
                rows.append(row)
        return {
            "events": [
                {
                    "kind": event.kind.value,
                    "create_time": event.create_time,
                    "data": codec.encode_data(event.kind, event.data),
                }
                for event in events
            ],
            "messages": rows,
        }


@dataclasses.dataclass(frozen=True)
class _FollowedCall:
    """``SELECT function($1::jsonb), <followed elsewhere>`` as one prepared statement:
    its name on every connection, its SQL, and its text for the statement observers
    (psycopg's placeholders, as the other statements are observed)."""

    function: str

    @property
    def name(self) -> bytes:
        return f"ballet_{self.function}".encode()

    @functools.cached_property
    def sql(self) -> bytes:
        followed = _FOLLOWED_ELSEWHERE.replace("%s", "$2", 1).replace("%s", "$3", 1)
        return f"SELECT {self.function}($1::jsonb), {followed}".encode()

    @property
    def text(self) -> str:
        return f"SELECT {self.function}(%s), {_FOLLOWED_ELSEWHERE}"


_FOLLOWED_CALLS: dict[str, _FollowedCall] = {}

#: Per connection, the statements ``_run_prepared`` has prepared on it.
_PREPARED: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], set[bytes]] = (
    weakref.WeakKeyDictionary()
)
_JSONB_OID = 3802
_INT8_OID = 20


async def _run_prepared(
    conn: psycopg.AsyncConnection[Any], name: bytes, sql: bytes, params: Sequence[bytes | None]
) -> PGresult:
    """Run the prepared statement ``name`` (preparing ``sql`` under it first on a
    connection that has not) with text ``params``; its result, one of rows. Raises
    psycopg's error of the server's answer (``translated_pg`` translates it).

    libpq's calls, waited for by psycopg's own ``wait`` (which cancels the statement in
    the server when the wait is cancelled): a cursor's execute costs about twice the
    CPU for the same statement (decision 0393). A statement the server no longer knows
    (a ``DEALLOCATE`` elsewhere) is prepared again once."""
    pgconn = conn.pgconn
    prepared = _PREPARED.setdefault(conn, set())
    for attempt in range(2):
        if name not in prepared:
            pgconn.send_prepare(name, sql)
            _raise_failed(await conn.wait(generators.execute(pgconn)), conn)
            prepared.add(name)
        pgconn.send_query_prepared(name, params)
        results = await conn.wait(generators.execute(pgconn))
        try:
            _raise_failed(results, conn)
        except pg_errors.InvalidSqlStatementName:
            prepared.discard(name)
            if attempt:
                raise
            continue
        last: PGresult = results[-1]
        return last
    raise AssertionError("unreachable")


def _raise_failed(results: Sequence[PGresult], conn: psycopg.AsyncConnection[Any]) -> None:
    for result in results:
        if result.status == pq.ExecStatus.FATAL_ERROR:
            raise pg_errors.error_from_result(result, encoding=conn.info.encoding)


def _value(result: PGresult, column: int) -> Any:
    """The first row's value of ``column`` (text format): ``jsonb`` parsed, ``bigint``
    an int, anything else text; None for NULL."""
    raw = result.get_value(0, column)
    if raw is None:
        return None
    kind = result.ftype(column)
    if kind == _JSONB_OID:
        return orjson.loads(raw)
    if kind == _INT8_OID:
        return int(raw)
    return raw.decode()


def _default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON")


def _dumps(value: Any) -> str:
    return json.dumps(value, default=_default, ensure_ascii=False, separators=(",", ":"))


def _json(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON, datetimes in ISO 8601 (as ``_dumps``), by orjson:
    a unit's argument in about a tenth of the standard library's time (decision 0395).
    Raises ``TypeError`` for what JSON cannot hold (a string that is not valid UTF-8, an
    integer beyond 64 bits)."""
    return orjson.dumps(value)


@contextmanager
def translated_pg() -> Iterator[None]:
    """Translate psycopg's errors raised inside the block (see the module docstring);
    anything else propagates unchanged: it is a bug, not a condition to handle."""
    try:
        yield
    except PoolTimeout as error:
        raise StoreUnavailable("no database connection was free in time") from error
    except psycopg.Error as error:
        if error.sqlstate == CONFLICT_SQLSTATE:
            raise StoreConflict(_first_line(error)) from error
        if isinstance(error, pg_errors.UniqueViolation):
            name = error.diag.constraint_name
            if name == UQ_ONE_RUNNING_TURN:
                raise FailedPrecondition(
                    "another turn is running in this session", reason="TURN_IN_PROGRESS"
                ) from error
            if name in (UQ_TURN_REQUEST_ID, UQ_SESSION_REQUEST_ID):
                raise RequestIdTaken(name) from error
            raise
        if isinstance(error, pg_errors.ForeignKeyViolation):
            raise StoreConflict(_first_line(error)) from error
        if isinstance(
            error, pg_errors.UntranslatableCharacter | pg_errors.CharacterNotInRepertoire
        ) or (isinstance(error, psycopg.DataError) and "NUL" in str(error)):
            # The server's refusal, or psycopg's own for a text parameter.
            raise InvalidArgument(
                "text fields cannot contain NUL (U+0000) characters", reason="NUL_CHARACTER"
            ) from error
        if isinstance(
            error,
            psycopg.OperationalError
            | psycopg.InterfaceError
            | pg_errors.DeadlockDetected
            | pg_errors.SerializationFailure,
        ):
            raise StoreUnavailable(f"the database is unavailable: {_first_line(error)}") from error
        raise


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


# ---------------------------------------------------------------------- the stores


@every_method_a_unit_of_work
class PgSessionStore(SqlSessionStore):
    """``SqlSessionStore`` on PostgreSQL with the hot path on ``pool`` (decision 0113):
    ``get_session``, ``start_turn``, ``commit``, ``renew_lease``, ``events_after`` and
    the insert of ``create_session`` are one statement each (decision 0227); the rest
    stays on SQLAlchemy (``engine``). The contract is the port's, unchanged, and the
    context cache is the base class's."""

    def __init__(
        self,
        engine: AsyncEngine,
        pool: AsyncConnectionPool[Any],
        replica_id: str,
        *,
        context_cache_bytes: int = CONTEXT_CACHE_BYTES,
        units_of_work: UnitsOfWork | None = None,
        observers: list[StatementObserver] | None = None,
    ) -> None:
        hot = PgHotPath(pool, observers=observers)
        super().__init__(
            engine,
            replica_id,
            notify=True,
            context_cache_bytes=context_cache_bytes,
            units_of_work=units_of_work,
            signals=Signals(hot.notify, replica_id),
        )
        self._hot = hot

    @read_unit
    async def ping(self) -> None:
        """See ``SqlSessionStore.ping``; the hot path's pool is checked too, so readiness
        after a restart or failover means both pools reach the (new) primary."""
        await super().ping()
        await self._hot.ping()

    @read_unit
    async def get_session(self, session_id: str) -> Session | None:
        """The session, or None (one statement)."""
        return await self._hot.get_session(session_id)

    async def _read_context(self, session_id: str) -> ContextSnapshot | None:
        return await self._hot.context(session_id)

    @read_unit
    async def events_after(
        self, session_id: str, after_sequence: int, limit: int
    ) -> list[SessionEvent]:
        """See ``SqlSessionStore.events_after`` (one statement): a stream's replay and
        catch-up, which every new Chat stream makes."""
        params = {
            "session_id": session_id,
            "after_sequence": after_sequence,
            "limit": max(limit, 0),
        }
        rows = await self._hot.rows(_EVENTS_AFTER, params)
        return [codec.event_from_row(row, units.MESSAGE_PREFIX) for row in rows]

    async def _insert_session(self, row: dict[str, Any]) -> None:
        # One autocommit statement instead of a transaction of SQLAlchemy's: every
        # session a Chat stream opens for a project starts here.
        await self._hot.execute(_insert_session_sql(tuple(row)), list(row.values()))

    async def renew_lease(self, turn_id: str, owner: str, until: datetime) -> LeaseStatus:
        """See ``SqlSessionStore.renew_lease`` (one statement)."""
        return await self._hot.renew_lease(turn_id, owner, units.utc(until))

    async def _start(self, start: TurnStart, human_index: int) -> tuple[TurnStartOutcome, bool]:
        turn = start.turn
        result, followed = await self._hot.call_followed(
            "planner_start_turn",
            {
                "turn": {**codec.turn_row(turn), "project_id": start.project_id},
                "now": units.utc(start.now),
                "human_index": human_index,
                "per_human": start.limits.per_human,
                "per_project": start.limits.per_project,
                "added_tokens": units.message_tokens(start.events),
                **self._hot.units(start.events),
            },
            turn.session_id,
            self._replica_id,
        )
        outcome = result["outcome"]
        if outcome == "started":
            stored_events = units.numbered(start.events, int(result["last_sequence"]))
            stored = copied(turn, human_sequence=stored_events[human_index].sequence)
            return TurnStartOutcome(StartOutcomeKind.STARTED, stored, stored_events), followed
        if outcome == "duplicate":
            event = result.get("event")
            duplicate = TurnStartOutcome(
                StartOutcomeKind.DUPLICATE,
                _turn(result["turn"]),
                () if event is None else (_event(event),),
            )
            return duplicate, False
        if outcome == "expired":
            return TurnStartOutcome(StartOutcomeKind.EXPIRED_TURN, _turn(result["turn"])), False
        if outcome == "not_found":
            raise units.session_not_found()
        if outcome == "reused":
            raise units.request_id_reused()
        if outcome == "in_progress":
            raise units.turn_in_progress()
        if outcome == "too_many":
            raise units.too_many_turns(str(result["scope"]), start.limits)
        raise RuntimeError(f"planner_start_turn answered {outcome!r}")

    async def _commit(self, commit: TurnCommit) -> tuple[int, list[SessionEvent], bool]:
        value, followed = await self._hot.call_followed(
            "planner_commit", self._commit_argument(commit), commit.session_id, self._replica_id
        )
        last = int(value)
        return last, units.numbered(commit.events, last), followed and bool(commit.events)

    async def _end_turn(
        self, commit: TurnCommit, promotion: Promotion
    ) -> tuple[int, list[SessionEvent], Promoted | None, bool]:
        """``planner_end_turn`` (migration 0008): the ending and the promotion of the
        first queued turn, one statement, with whether another replica follows."""
        result, followed = await self._hot.call_followed(
            "planner_end_turn",
            {
                **self._commit_argument(commit),
                "promote": {
                    "owner": promotion.owner,
                    "lease_expires_at": units.utc(promotion.lease_expires_at),
                    "model": promotion.model,
                    "turn_started": codec.encode_data(
                        EventKind.TURN_STARTED,
                        TurnStartedData(promotion.model, promotion.max_rounds),
                    ),
                },
            },
            commit.session_id,
            self._replica_id,
        )
        last = int(result["last"])
        row = result.get("promoted")
        if row is None:
            return last, units.numbered(commit.events, last), None, followed
        now = units.utc(commit.now)
        queued = _turn(row)
        events = units.numbered(
            units.promotion_events(
                queued.turn_id, commit.session_id, row["queued_message"], promotion, now
            ),
            last,
        )
        promoted = Promoted(
            units.promoted_turn(queued, promotion, now, last - 1),
            events,
            row["queued_token"] or "",
        )
        return last, units.numbered(commit.events, last - 2), promoted, followed

    def _commit_argument(self, commit: TurnCommit) -> dict[str, Any]:
        """The argument of ``planner_commit`` for ``commit``."""
        context = commit.context
        summary = commit.summary
        return {
            "session_id": commit.session_id,
            "turn_id": commit.turn_id,
            "now": units.utc(commit.now),
            "owner": commit.owner,
            "lease_expired_before": None
            if commit.lease_expired_before is None
            else units.utc(commit.lease_expired_before),
            "patch": units.patch_values(commit.turn_patch, units.utc(commit.now)),
            "summary": None if summary is None else summary.summary,
            "summary_up_to": None if summary is None else summary.up_to,
            "context": None
            if context is None
            else {
                "base_tokens": context.base_tokens,
                "pending_tokens": context.pending_tokens,
            },
            "added_tokens": units.message_tokens(commit.events),
            **self._hot.units(commit.events),
        }


@every_method_a_unit_of_work
class PgStreamStore(SqlStreamStore):
    """``SqlStreamStore`` on PostgreSQL with a stream's opening and closing on ``pool``,
    one statement each (decision 0113)."""

    def __init__(
        self,
        engine: AsyncEngine,
        pool: AsyncConnectionPool[Any],
        *,
        units_of_work: UnitsOfWork | None = None,
        observers: list[StatementObserver] | None = None,
    ) -> None:
        super().__init__(engine, units_of_work=units_of_work)
        self._hot = PgHotPath(pool, observers=observers)

    async def open_stream(self, stream: OpenStream, *, limit: int, now: datetime) -> bool:
        """See ``SqlStreamStore.open_stream`` (one statement)."""
        admitted = await self._hot.call(
            "planner_open_stream",
            {
                "stream_id": stream.stream_id,
                "human_id": stream.human_id,
                "replica_id": stream.replica_id,
                "opened_at": units.utc(stream.opened_at),
                "limit": limit,
                "now": units.utc(now),
            },
        )
        return bool(admitted)

    async def close_streams(self, stream_ids: Sequence[str]) -> None:
        """See ``SqlStreamStore.close_streams`` (one statement)."""
        if stream_ids:
            await self._hot.close_streams(stream_ids)


_TIMES = ("start_time", "end_time", "lease_expires_at", "create_time")


def _timed(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row read as JSON with its timestamps parsed back."""
    out = dict(row)
    for key in _TIMES:
        value = out.get(key)
        if isinstance(value, str):
            out[key] = datetime.fromisoformat(value)
    return out


def _turn(row: Mapping[str, Any]) -> Turn:
    return codec.turn_from_row(_timed(row))


def _event(row: Mapping[str, Any]) -> SessionEvent:
    fields = _timed(row)
    message = fields.pop("message", None)
    prefixed = {units.MESSAGE_PREFIX + "message_id": None}
    if message is not None:
        prefixed = {units.MESSAGE_PREFIX + k: v for k, v in _timed(message).items()}
    return codec.event_from_row({**fields, **prefixed}, units.MESSAGE_PREFIX)


def _retrieved(task: asyncio.Task[None]) -> None:
    # A check that failed is tried again at the next broken connection.
    if not task.cancelled() and task.exception() is not None:
        log.debug("hot pool: checking idle connections failed", exc_info=task.exception())
