"""A database failover under load: the primary dies, its synchronous standby is promoted.

A primary (fsync on, ``synchronous_standby_names = '*'``) and a streaming standby made
with ``pg_basebackup -R`` run on loopback. ``ballet-planner migrate`` and two
``ballet-planner serve`` processes use one multi-host URL with
``target_session_attrs=read-write``, so every connection they open (both pools, the
LISTEN connection, the migration's) finds whichever host accepts writes. A client on each
replica sends message after message on a Chat stream. The primary stops (``immediate``:
a crash, to PostgreSQL) while turns run; both replicas report NOT_SERVING; the standby is
promoted. Then, within 15 s of the promotion, both report SERVING and complete a turn;
every turn a client saw accepted is stored, with every event a client received, and no
turn is left running.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
from ballet.planner.v1 import resources_pb2 as res
from grpc_health.v1 import health_pb2

from tests.pg import PgCluster
from tests.replicas.support import END, ChatStream, Metadata, Planner, Received, rig

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: The bound of the failover: SERVING and a completed turn on every replica after it.
FAILOVER_LIMIT_S = 15.0

SCENARIO = {
    "rules": [
        {
            "match": {"last_role": "human"},
            "reply": {"text": "Noted; the plan goes on.", "chunk_chars": 6, "delay_ms": 60},
        }
    ]
}


def multi_host_url(*clusters: PgCluster) -> str:
    hosts = "&".join(f"host=127.0.0.1:{cluster.port}" for cluster in clusters)
    return f"postgresql+psycopg://postgres@/planner?{hosts}&target_session_attrs=read-write"


async def wait_synchronous(primary: PgCluster, limit_s: float = 30.0) -> None:
    """Wait until the primary has a synchronous standby streaming from it."""
    deadline = time.monotonic() + limit_s
    while True:
        async with await psycopg.AsyncConnection.connect(primary.admin_url()) as conn:
            cursor = await conn.execute(
                "SELECT count(*) FROM pg_stat_replication "
                "WHERE sync_state = 'sync' AND state = 'streaming'"
            )
            row = await cursor.fetchone()
        if row is not None and row[0] >= 1:
            return
        assert time.monotonic() < deadline, "the standby never became synchronous"
        await asyncio.sleep(0.1)


@dataclass
class Client:
    """Sends one message after another on a Chat stream of its own session, reopening the
    stream after the last event it got whenever it breaks; keeps what it was shown."""

    name: str
    planner: Planner
    meta: Metadata
    session_id: str
    #: Session events received, every stream of the client's included.
    events: list[Received] = field(default_factory=list)
    #: turn_id -> when its message_accepted arrived.
    accepted: dict[str, float] = field(default_factory=dict)
    #: turn_id -> (end reason, when its turn_ended arrived).
    ended: dict[str, tuple[int, float]] = field(default_factory=dict)
    refused: int = 0
    #: Streams reopened because one broke or stalled.
    reopened: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait (unbounded: callers bound it) until ``predicate()`` holds."""
        while True:
            self.changed.clear()
            if predicate():
                return
            await self.changed.wait()

    def last_sequence(self) -> int:
        return max((r.response.sequence for r in self.events), default=0)

    async def _open(self) -> ChatStream:
        while True:
            stream = ChatStream.open(self.planner, self.meta)
            stream.attach(self.session_id, after_sequence=self.last_sequence())
            try:
                await stream.opened(timeout_s=5)
                return stream
            except (AssertionError, TimeoutError):
                await stream.close()
                await asyncio.sleep(0.2)

    def _keep(self, stream: ChatStream, seen: int) -> int:
        for received in stream.events()[seen:]:
            self.events.append(received)
            response = received.response
            if received.kind == "message_accepted":
                self.accepted.setdefault(response.turn_id, received.at)
            elif received.kind == "turn_ended":
                self.ended[response.turn_id] = (response.turn_ended.reason, received.at)
        self.changed.set()
        return len(stream.events())

    async def run(self) -> None:
        stream = await self._open()
        seen = 0
        number = 0
        try:
            while not self.stop.is_set():
                number += 1
                accepted = sum(r.kind == "message_accepted" for r in stream.events())
                refused = len(stream.errors())
                stream.say(f"step {number}", f"{self.name}-{number}")
                try:
                    await stream.wait_for(
                        lambda got, a=accepted, e=refused: (
                            sum(r.kind == "message_accepted" for r in got) > a
                            or sum(r.kind == "error" for r in got) > e
                        ),
                        timeout_s=10,
                    )
                    seen = self._keep(stream, seen)
                    if len(stream.errors()) > refused:
                        self.refused += 1
                        await asyncio.sleep(0.1)
                        continue
                    turn_id = [r for r in stream.events() if r.kind == "message_accepted"][
                        -1
                    ].response.turn_id
                    await stream.turn_ended(turn_id, timeout_s=30)
                    seen = self._keep(stream, seen)
                except (AssertionError, TimeoutError):
                    # The stream broke (or stalled): reopen after the last event kept.
                    seen = self._keep(stream, seen)
                    self.reopened += 1
                    await stream.close()
                    stream = await self._open()
                    seen = 0
        finally:
            self._keep(stream, seen)
            await stream.close()

    def completed_after(self, moment: float) -> float | None:
        """When the first turn accepted after ``moment`` completed (None: none did)."""
        times = [
            at
            for turn_id, (reason, at) in self.ended.items()
            if reason == END.TURN_END_REASON_COMPLETED and self.accepted.get(turn_id, 0) > moment
        ]
        return min(times, default=None)


def identity(event: Received) -> tuple[int, str]:
    message = getattr(getattr(event.response, event.kind), "message", None)
    return event.response.sequence, message.message_id if message else ""


async def test_a_failover_to_a_synchronous_standby_loses_nothing_acknowledged(
    tmp_path: Path,
    primary_and_standby: tuple[PgCluster, PgCluster],
    record_property: Callable[[str, object], None],
) -> None:
    primary, standby = primary_and_standby
    await wait_synchronous(primary)
    url = multi_host_url(primary, standby)
    async with rig(tmp_path, url, SCENARIO, planner={"sweep_interval_s": 1.0}) as r:
        clients = [
            Client(p.name, p, r.alice, await p.create_session(r.alice, f"create-{p.name}"))
            for p in (r.a, r.b)
        ]
        running = [asyncio.create_task(c.run()) for c in clients]
        try:
            # Turns complete on both replicas before the failover.
            async with asyncio.timeout(20):
                for client in clients:
                    await client.wait_until(lambda c=client: len(c.ended) >= 2)

            stopped_at = time.monotonic()
            await asyncio.to_thread(primary.stop, "immediate")
            await asyncio.gather(r.a.wait_health(NOT_SERVING, 10), r.b.wait_health(NOT_SERVING, 10))
            not_serving_s = time.monotonic() - stopped_at
            promoted_at = time.monotonic()
            await asyncio.to_thread(standby.promote)
            promote_s = time.monotonic() - promoted_at
            serving = await asyncio.gather(
                *(p.wait_health(SERVING, FAILOVER_LIMIT_S) for p in (r.a, r.b))
            )
            completed: list[float] = []
            async with asyncio.timeout(FAILOVER_LIMIT_S - (time.monotonic() - promoted_at)):
                for client in clients:
                    await client.wait_until(
                        lambda c=client: c.completed_after(promoted_at) is not None
                    )
                    completed.append((client.completed_after(promoted_at) or 0) - promoted_at)
        finally:
            for client in clients:
                client.stop.set()
            results = await asyncio.gather(*running, return_exceptions=True)
        assert not [e for e in results if isinstance(e, BaseException)], results

        record_property("not_serving_after_stop_s", round(not_serving_s, 3))
        record_property("promote_s", round(promote_s, 3))
        record_property("serving_after_promotion_s", [round(s, 3) for s in serving])
        record_property("completed_turn_after_promotion_s", [round(s, 3) for s in completed])
        assert max(completed) < FAILOVER_LIMIT_S

        # Every turn a client saw accepted is stored and has ended, none is left running.
        reasons: dict[int, int] = {}
        for client in clients:
            for turn_id in client.accepted:
                turn = await client.planner.wait_turn_ended(
                    r.alice, client.session_id, turn_id, limit_s=20
                )
                assert turn.state == res.TURN_STATE_ENDED
                if turn_id in client.ended:  # the end a client was shown is the stored one
                    assert turn.end_reason == client.ended[turn_id][0], turn
                reasons[turn.end_reason] = reasons.get(turn.end_reason, 0) + 1
        assert set(reasons) <= {
            END.TURN_END_REASON_COMPLETED,
            END.TURN_END_REASON_FAILED,
            END.TURN_END_REASON_INTERRUPTED,
        }, reasons
        record_property("streams_reopened", sum(c.reopened for c in clients))
        record_property("turns_accepted", sum(len(c.accepted) for c in clients))
        record_property("turns_failed", reasons.get(END.TURN_END_REASON_FAILED, 0))
        record_property("turns_interrupted", reasons.get(END.TURN_END_REASON_INTERRUPTED, 0))
        async with await psycopg.AsyncConnection.connect(
            f"host=127.0.0.1 port={standby.port} dbname=planner user=postgres"
        ) as conn:
            cursor = await conn.execute("SELECT count(*) FROM turns WHERE state = 'running'")
            assert await cursor.fetchone() == (0,)

        # Every event a client received is in the transcript, in its place.
        for client in clients:
            stored = {
                (m.sequence, m.message_id)
                for m in await client.planner.messages(r.alice, client.session_id)
            }
            shown = {identity(e) for e in client.events if identity(e)[1]}
            assert shown <= stored, sorted(shown - stored)
