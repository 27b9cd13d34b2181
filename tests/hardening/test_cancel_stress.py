"""Clients that cancel at random points, against two replicas on one PostgreSQL.

Two ``ballet-planner serve`` processes share one PostgreSQL database and the devstack
(the scripted model answers in a few milliseconds). Every cancel is a real gRPC cancel of
a real call (``call.cancel()``: the client resets the HTTP/2 stream) at a random moment:

1. **Turns.** Chat calls (open a session, send a message) and unary ``SendMessage``
   calls, each cancelled within its first 50 ms (longer on a machine too loaded to accept
   a message within that: the window is 1.5 times the measured time to
   ``message_accepted``, so cancels land before, during and after the accepting
   commit). A disconnect is not a cancel (docs/spec/api-and-streams.md): every turn that was stored
   must run to ``turn_ended`` on its own (none ``INTERRUPTED``, which only a sweeper or a
   shutdown gives), and the next message in each session is accepted at once (no
   ``TURN_IN_PROGRESS``).
2. **Open and close.** Chat calls cancelled while their stream registers, while it
   opens a session, and while it closes. Afterwards no ``chat_streams`` row outlives the
   documented bound (one stream heartbeat, decision 0182), and a human with no open
   stream opens 16 streams on each replica.
3. **A storm.** Calls of every RPC started at a steady rate and cancelled at random
   points for a while.

Then, and after each phase where it applies: no turn left running, no stream row, the
open-streams gauge at 0 and no database connection checked out on either replica within
5 s (their ``ballet_planner_database_connections_in_use`` gauge, and PostgreSQL's own
view of the planner's connections), and no SQLAlchemy "garbage collector" line, no
un-retrieved task exception and no traceback in either replica's log.

The sizes are parameters: a small run for every CI run, the full sizes
(``FULL``: 1,000 + 1,000 turn cancels, 2,000 open/close cancels, 60 s at 50 cancels/s)
marked ``slow``. Measured figures are recorded as test properties.
"""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from ballet.planner.v1 import planner_service_pb2 as pb
from ballet.planner.v1 import planner_service_pb2_grpc
from ballet.planner.v1 import resources_pb2 as res
from grpc_status import rpc_status
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.adapters.store import make_engine
from tests.hardening.support import (
    WAIT_S,
    Chat,
    Metadata,
    PlannerProcess,
    Stack,
    error_info,
    eventually,
    open_request,
    send_request,
    serve_process,
    start_stack,
)

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(1200)]


@dataclass(frozen=True)
class Sizes:
    """How much of each phase a run does."""

    chat_turns: int
    unary_turns: int
    open_close: int
    storm_s: float
    storm_rate: float
    concurrency: int = 8


SMALL = Sizes(chat_turns=80, unary_turns=80, open_close=200, storm_s=5.0, storm_rate=50.0)
#: The sizes of the full run (decision 0184).
FULL = Sizes(chat_turns=1000, unary_turns=1000, open_close=2000, storm_s=60.0, storm_rate=50.0)

#: The first 50 ms of a call: where the cancels land.
CANCEL_WITHIN_S = 0.05
#: Stream heartbeat of the replicas here: ``min(lease_s / 3, sweep_interval_s)``.
LEASE_S = 6.0
SWEEP_S = 1.0
#: Decision 0182's bound on an orphan ``chat_streams`` row: one heartbeat, plus the time
#: its statements take on a loaded machine.
ORPHAN_BOUND_S = SWEEP_S + 2.0
#: The pools back to 0 checked out within this.
POOL_BOUND_S = 5.0
STREAMS_PER_HUMAN = 16
#: Lines that must never appear in a replica's log.
FORBIDDEN = (
    "garbage collector",
    "was never retrieved",
    "Traceback",
    "Exception during reset",
    # Decision 0182: every stream gives its row back itself; the heartbeat finds none.
    "without an open stream",
    # Decision 0313: a client that gave up is not an error (grpc.aio's own line for it).
    "ExecuteBatchError",
    '"level": "ERROR"',
)

RULES: list[dict[str, Any]] = [
    {"match": {"purpose": "compaction"}, "reply": {"text": "A summary."}},
    # A short streamed answer: cancels land before, during and after the model call.
    {"reply": {"text": "An answer in a few pieces.", "chunk_chars": 8, "delay_ms": 2}},
]


@dataclass
class Replicas:
    stack: Stack
    processes: list[PlannerProcess]
    channels: list[grpc.aio.Channel]
    stubs: list[planner_service_pb2_grpc.PlannerServiceStub]
    engine: AsyncEngine
    alice: Metadata

    def stub(self, index: int) -> planner_service_pb2_grpc.PlannerServiceStub:
        return self.stubs[index % len(self.stubs)]


@pytest.fixture
async def replicas(tmp_path: Path, pg_url: str) -> AsyncIterator[Replicas]:
    stack = await start_stack(tmp_path / "data", RULES, database_url=pg_url)
    processes: list[PlannerProcess] = []
    channels: list[grpc.aio.Channel] = []
    engine = make_engine(pg_url)
    try:
        for name in ("a", "b"):
            processes.append(
                await serve_process(
                    stack,
                    tmp_path / f"{name}.log",
                    SERVER__REPLICA_ID=f"replica-{name}",
                    PLANNER__LEASE_S=str(LEASE_S),
                    PLANNER__SWEEP_INTERVAL_S=str(SWEEP_S),
                    # Turns keep running after their caller left: room for all of them.
                    LIMITS__TURNS_PER_HUMAN="200",
                    LIMITS__TURNS_PER_PROJECT="200",
                    LIMITS__STREAMS_PER_HUMAN=str(STREAMS_PER_HUMAN),
                    DATABASE__POOL_SIZE="5",
                    DATABASE__HOT_POOL_SIZE="10",
                )
            )
        channels = [grpc.aio.insecure_channel(p.address) for p in processes]
        yield Replicas(
            stack,
            processes,
            channels,
            [planner_service_pb2_grpc.PlannerServiceStub(c) for c in channels],
            engine,
            stack.auth("alice"),
        )
    finally:
        for channel in channels:
            await channel.close()
        for process in processes:
            process.stop()
        await engine.dispose()
        await stack.stop()


# --------------------------------------------------------------------------- cancels


async def cancel_after(delay_s: float, call: Any, drive: Awaitable[Any] | None = None) -> None:
    """Cancel ``call`` ``delay_s`` after now (a real client cancel), while ``drive`` (its
    writes and reads) runs; whatever either raises is the cancel's doing."""
    task = asyncio.ensure_future(drive if drive is not None else call)
    await asyncio.wait({task}, timeout=delay_s)
    call.cancel()
    # grpc.aio leaves a write that was waiting on a cancelled call waiting: the driver
    # is this test's own code, so it stops here too.
    task.cancel()
    await asyncio.wait({task}, timeout=WAIT_S)
    assert task.done(), f"a cancelled call did not end: {call!r}"
    if not task.cancelled():
        task.exception()


async def read_all(call: Any) -> None:
    while await call.read() is not grpc.aio.EOF:
        pass


async def chat_send_cancelled(r: Replicas, index: int, session_id: str, delay_s: float) -> None:
    call = r.stub(index).Chat(metadata=r.alice)

    async def drive() -> None:
        await call.write(open_request(session_id=session_id))
        await call.write(send_request("hello", f"chat-{uuid.uuid4().hex}"))
        await read_all(call)

    await cancel_after(delay_s, call, drive())


async def unary_send_cancelled(r: Replicas, index: int, session_id: str, delay_s: float) -> None:
    call = r.stub(index).SendMessage(
        pb.SendMessageRequest(
            session_id=session_id, text="hello", request_id=f"unary-{uuid.uuid4().hex}"
        ),
        metadata=r.alice,
        timeout=30,
    )
    await cancel_after(delay_s, call)


async def open_close_cancelled(r: Replicas, index: int, session_id: str, rng: random.Random) -> str:
    """One Chat call cancelled while it registers, opens or closes; returns which."""
    call = r.stub(index).Chat(metadata=r.alice)
    where = rng.choice(("register", "open", "close"))
    if where == "register":
        await cancel_after(rng.uniform(0, 0.01), call, read_all(call))
    elif where == "open":

        async def drive_open() -> None:
            await call.write(open_request(session_id=session_id))
            await read_all(call)

        await cancel_after(rng.uniform(0, 0.02), call, drive_open())
    else:

        async def drive_close() -> None:
            await call.write(open_request(session_id=session_id))
            response = await call.read()
            assert response is not grpc.aio.EOF
            await call.done_writing()
            await read_all(call)

        # Long enough to open, short enough to land in the close most of the time.
        await cancel_after(rng.uniform(0.005, 0.03), call, drive_close())
    return where


async def in_parallel(
    count: int, concurrency: int, one: Callable[[int], Awaitable[Any]]
) -> list[Any]:
    """Run ``one(i)`` for i < count, ``concurrency`` at a time; their results."""
    results: list[Any] = [None] * count
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < count:
            index = next_index
            next_index += 1
            results[index] = await one(index)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def create_sessions(r: Replicas, count: int, concurrency: int) -> list[str]:
    async def create(index: int) -> str:
        response = await r.stub(index).CreateSession(
            pb.CreateSessionRequest(request_id=uuid.uuid4().hex, project_id="demo", title="t"),
            metadata=r.alice,
            timeout=30,
        )
        return str(response.session.session_id)

    sessions: list[str] = await in_parallel(count, concurrency, create)
    return sessions


# --------------------------------------------------------------------------- checks


def metric(address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


async def gauges(r: Replicas, name: str) -> list[float]:
    return [await asyncio.to_thread(metric, p.metrics_address, name) for p in r.processes]


async def scalar(r: Replicas, sql: str) -> Any:
    async with r.engine.connect() as conn:
        return (await conn.execute(text(sql))).scalar_one()


async def turns_settle(r: Replicas, limit_s: float = 30.0) -> None:
    """Every stored turn ended on its own: none running after ``limit_s`` (the turns
    take milliseconds; the lease is longer, so no sweeper could have ended one)."""

    async def none_running() -> bool:
        return int(await scalar(r, "SELECT count(*) FROM turns WHERE state = 'running'")) == 0

    try:
        await eventually(none_running, limit_s)
    except AssertionError:
        async with r.engine.connect() as conn:
            rows = (
                await conn.execute(
                    text(
                        "SELECT turn_id, owner, rounds, start_time FROM turns "
                        "WHERE state = 'running' LIMIT 10"
                    )
                )
            ).all()
        raise AssertionError(f"turns still running after {limit_s} s: {rows}") from None


async def assert_turns_ended_by_their_runs(r: Replicas) -> None:
    interrupted = int(
        await scalar(r, "SELECT count(*) FROM turns WHERE end_reason = 'interrupted'")
    )
    assert interrupted == 0, f"{interrupted} turns were interrupted (lost, then swept)"
    without_end = int(
        await scalar(
            r,
            "SELECT count(*) FROM turns t WHERE NOT EXISTS (SELECT 1 FROM session_events e "
            "WHERE e.session_id = t.session_id AND e.turn_id = t.turn_id "
            "AND e.kind = 'turn_ended')",
        )
    )
    assert without_end == 0, f"{without_end} turns have no turn_ended event"


async def assert_no_stream_left(r: Replicas) -> float:
    """No ``chat_streams`` row within the documented bound, and no stream open in either
    replica's memory; returns how long the rows took to go."""
    started = time.monotonic()

    async def no_rows() -> bool:
        return int(await scalar(r, "SELECT count(*) FROM chat_streams")) == 0

    try:
        await eventually(no_rows, ORPHAN_BOUND_S)
    except AssertionError:
        rows = int(await scalar(r, "SELECT count(*) FROM chat_streams"))
        raise AssertionError(f"{rows} chat_streams rows outlived {ORPHAN_BOUND_S} s") from None
    took = time.monotonic() - started

    async def no_open_streams() -> bool:
        return await gauges(r, "ballet_planner_open_streams") == [0.0, 0.0]

    await eventually(no_open_streams, ORPHAN_BOUND_S)
    return took


async def assert_pools_idle(r: Replicas) -> float:
    """Both replicas' pools back to 0 checked out within ``POOL_BOUND_S``, and PostgreSQL
    sees none of the planners' connections busy or idle in a transaction; returns how
    long it took."""
    started = time.monotonic()

    async def idle() -> bool:
        if await gauges(r, "ballet_planner_database_connections_in_use") != [0.0, 0.0]:
            return False
        busy = await scalar(
            r,
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'ballet-planner' "
            "AND state IN ('active', 'idle in transaction', 'idle in transaction (aborted)') "
            "AND query NOT ILIKE 'LISTEN%' AND pid <> pg_backend_pid()",
        )
        return int(busy) == 0

    try:
        await eventually(idle, POOL_BOUND_S)
    except AssertionError:
        in_use = await gauges(r, "ballet_planner_database_connections_in_use")
        async with r.engine.connect() as conn:
            states = (
                await conn.execute(
                    text(
                        "SELECT state, left(query, 60), count(*) FROM pg_stat_activity "
                        "WHERE application_name = 'ballet-planner' "
                        "AND pid <> pg_backend_pid() GROUP BY 1, 2"
                    )
                )
            ).all()
        raise AssertionError(
            f"connections still in use after {POOL_BOUND_S} s: gauges {in_use}, "
            f"PostgreSQL {states}"
        ) from None
    return time.monotonic() - started


def assert_clean_logs(r: Replicas) -> None:
    for process in r.processes:
        log = process.log()
        for needle in FORBIDDEN:
            assert needle not in log, f"{needle!r} in {process.log_path.name}:\n{log[-4000:]}"


# --------------------------------------------------------------------------- phases


async def time_to_accept(r: Replicas, sessions: list[str], concurrency: int) -> float:
    """The median time from a Chat call's start to its ``message_accepted``, with
    ``concurrency`` such calls at once (none cancelled)."""
    took: list[float] = []

    async def one(index: int) -> None:
        chat = Chat(r.stub(index), r.alice)
        started = time.monotonic()
        await chat.send(open_request(session_id=sessions[index]))
        await chat.send(send_request("calibrating", f"calibrate-{index}"))
        await chat.until("message_accepted")
        took.append(time.monotonic() - started)
        await chat.until("turn_ended")
        chat.cancel()

    await in_parallel(len(sessions), concurrency, one)
    return sorted(took)[len(took) // 2]


async def turn_cancels(r: Replicas, sizes: Sizes, rng: random.Random) -> dict[str, float]:
    total = sizes.chat_turns + sizes.unary_turns
    sessions = await create_sessions(r, total, sizes.concurrency)
    # The cancels land within the first 50 ms, which on a quick machine spans a call's
    # accepting and more; on a loaded one a message may take longer than that to be
    # accepted, and the window grows so that cancels still land before, during and after
    # the commit that accepts it.
    accept_s = await time_to_accept(r, sessions[: 2 * sizes.concurrency], sizes.concurrency)
    window_s = max(CANCEL_WITHIN_S, 1.5 * accept_s)
    kinds = ["chat"] * sizes.chat_turns + ["unary"] * sizes.unary_turns
    rng.shuffle(kinds)
    stored_before = int(await scalar(r, "SELECT count(*) FROM turns"))
    started = time.monotonic()

    async def one(index: int) -> None:
        delay = rng.uniform(0, window_s)
        if kinds[index] == "chat":
            await chat_send_cancelled(r, index, sessions[index], delay)
        else:
            await unary_send_cancelled(r, index, sessions[index], delay)

    await in_parallel(total, sizes.concurrency, one)
    cancelling_s = time.monotonic() - started
    await turns_settle(r)
    await assert_turns_ended_by_their_runs(r)
    stored = int(await scalar(r, "SELECT count(*) FROM turns")) - stored_before
    assert stored > 0, "no cancel landed after a message was accepted"

    # The next message in each session is accepted at once, on the other replica.
    async def next_message(index: int) -> None:
        try:
            response = await r.stub(index + 1).SendMessage(
                pb.SendMessageRequest(
                    session_id=sessions[index], text="and now?", request_id=f"next-{index}"
                ),
                metadata=r.alice,
                timeout=30,
            )
        except grpc.aio.AioRpcError as error:
            status = rpc_status.from_call(error)
            reason = error_info(status).reason if status is not None else ""
            raise AssertionError(f"the next message was refused: {error.code()} {reason}") from None
        assert response.turn.end_reason == res.TURN_END_REASON_COMPLETED

    await in_parallel(total, sizes.concurrency, next_message)
    return {
        "turn_calls": total,
        "turns_stored": stored,
        "time_to_accept_s": accept_s,
        "cancel_window_s": window_s,
        "turn_cancels_s": cancelling_s,
    }


async def open_close_cancels(r: Replicas, sizes: Sizes, rng: random.Random) -> dict[str, float]:
    sessions = await create_sessions(r, 8, 4)
    counts = {"register": 0, "open": 0, "close": 0}
    started = time.monotonic()

    async def one(index: int) -> None:
        where = await open_close_cancelled(r, index, sessions[index % len(sessions)], rng)
        counts[where] += 1

    await in_parallel(sizes.open_close, sizes.concurrency, one)
    cancelling_s = time.monotonic() - started
    rows_gone_s = await assert_no_stream_left(r)

    # A human with no open stream opens 16 on each replica (one replica at a time: the
    # limit counts across replicas).
    for index in range(2):
        chats = [Chat(r.stub(index), r.alice) for _ in range(STREAMS_PER_HUMAN)]
        for chat in chats:
            await chat.open(session_id=sessions[0])
        for chat in chats:
            await chat.close()
        await assert_no_stream_left(r)
    return {
        "open_close_cancels": sizes.open_close,
        "open_close_cancels_s": cancelling_s,
        "orphan_rows_gone_s": rows_gone_s,
        **{f"cancelled_during_{k}": v for k, v in counts.items()},
    }


async def storm(r: Replicas, sizes: Sizes, rng: random.Random) -> dict[str, float]:
    sessions = await create_sessions(r, 16, 4)
    async with r.engine.connect() as conn:
        turns = [
            (str(row.session_id), str(row.turn_id))
            for row in await conn.execute(text("SELECT session_id, turn_id FROM turns LIMIT 100"))
        ]
    calls: set[asyncio.Task[None]] = set()

    def unary(index: int, method: str, request: Any) -> Callable[[float], Awaitable[None]]:
        async def run(delay: float) -> None:
            call = getattr(r.stub(index), method)(request, metadata=r.alice, timeout=30)
            await cancel_after(delay, call)

        return run

    def pick(index: int) -> Callable[[float], Awaitable[None]]:
        session_id = rng.choice(sessions)
        turn_session, turn_id = rng.choice(turns)
        kind = rng.randrange(10)
        if kind == 0:
            return lambda delay: chat_send_cancelled(r, index, session_id, delay)
        if kind == 1:

            async def open_close(_: float) -> None:
                await open_close_cancelled(r, index, session_id, rng)

            return open_close
        requests: list[tuple[str, Any]] = [
            (
                "SendMessage",
                pb.SendMessageRequest(
                    session_id=session_id, text="storm", request_id=uuid.uuid4().hex
                ),
            ),
            ("GetSession", pb.GetSessionRequest(session_id=session_id)),
            ("ListMessages", pb.ListMessagesRequest(session_id=session_id, page_size=50)),
            ("ListSessions", pb.ListSessionsRequest(project_id="demo")),
            (
                "CreateSession",
                pb.CreateSessionRequest(request_id=uuid.uuid4().hex, project_id="demo"),
            ),
            ("GetTurn", pb.GetTurnRequest(session_id=turn_session, turn_id=turn_id)),
            ("CancelTurn", pb.CancelTurnRequest(session_id=session_id)),
            ("UpdateSession", pb.UpdateSessionRequest(session=_titled(session_id))),
        ]
        method, request = requests[kind - 2]
        return unary(index, method, request)

    interval = 1.0 / sizes.storm_rate
    started = time.monotonic()
    launched = 0
    while time.monotonic() - started < sizes.storm_s:
        run = pick(launched)
        task = asyncio.get_running_loop().create_task(run(rng.uniform(0, CANCEL_WITHIN_S)))
        calls.add(task)
        task.add_done_callback(calls.discard)
        launched += 1
        # Pacing the launches, not waiting for anything.
        await asyncio.sleep(max(0.0, started + launched * interval - time.monotonic()))
    elapsed = time.monotonic() - started
    await asyncio.gather(*calls, return_exceptions=True)
    await turns_settle(r)
    return {"storm_calls": launched, "storm_rate_per_s": launched / elapsed}


def _titled(session_id: str) -> Any:
    return res.Session(session_id=session_id, title="renamed in the storm")


# --------------------------------------------------------------------------- the test


@pytest.mark.parametrize(
    "sizes",
    [pytest.param(SMALL, id="small"), pytest.param(FULL, id="full", marks=pytest.mark.slow)],
)
async def test_random_client_cancels_lose_no_turn_slot_or_connection(
    replicas: Replicas, sizes: Sizes, record_property: Callable[[str, object], None]
) -> None:
    r = replicas
    rng = random.Random(12)
    measured: dict[str, float] = {}
    started = time.monotonic()

    measured |= await turn_cancels(r, sizes, rng)
    measured["pools_idle_after_turns_s"] = await assert_pools_idle(r)
    assert_clean_logs(r)

    measured |= await open_close_cancels(r, sizes, rng)
    measured["pools_idle_after_open_close_s"] = await assert_pools_idle(r)
    assert_clean_logs(r)

    measured |= await storm(r, sizes, rng)
    measured["pools_idle_after_storm_s"] = await assert_pools_idle(r)
    await assert_turns_ended_by_their_runs(r)
    await assert_no_stream_left(r)
    assert_clean_logs(r)

    measured["total_s"] = time.monotonic() - started
    for key, value in measured.items():
        record_property(key, round(value, 3) if isinstance(value, float) else value)
