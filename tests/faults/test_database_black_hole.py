"""A database black hole, for real (decisions 0310 and 0315; bounds shortened by
configuration).

PostgreSQL runs in a network namespace of its own; iptables DROP rules inside it make it
silent: no reset, no answer, as a failed host or a partition. The store is opened as the
planner opens it, with its pools warm (every pooled connection was healthy a moment
before). During the hole every unit of work (reads, a write, the health ping, a lease
renewal) fails ``StoreUnavailable`` within its deadline, whatever connection it got;
the write that failed is not executed when the hole heals; after the heal the store
answers at once, and what was acknowledged before the hole is all there.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest

from service.adapters.store import migrate
from service.adapters.store.database import open_database
from service.adapters.store.engine import SocketBounds
from service.core.errors import StoreUnavailable
from tests.faults.net import silent_database
from tests.integration.store_support import REPLICA, T0, new_session, unique

pytestmark = pytest.mark.postgres

#: Shortened bounds (the defaults are 10 s and 8 s; the mechanism is the same).
UNIT_TIMEOUT_S = 3.0
BOUNDS = SocketBounds(tcp_user_timeout_s=2.0, keepalives_idle_s=1, keepalives_interval_s=1)
#: A hole far longer than every bound, as a 180 s one is with the defaults.
HOLE_S = 12.0
#: What a failed unit may take past its deadline (scheduling on a loaded machine).
SLACK_S = 1.5


async def test_every_wait_ends_within_its_bound_and_nothing_runs_after_the_heal() -> None:
    with silent_database() as (cluster, hole):
        url = cluster.url("postgres")
        await migrate(url)
        database = await open_database(
            url,
            replica_id=REPLICA,
            unit_timeout_s=UNIT_TIMEOUT_S,
            bounds=BOUNDS,
            connect_timeout_s=2,
            pool_timeout_s=UNIT_TIMEOUT_S,
        )
        try:
            store = database.sessions
            kept = [unique("kept") for _ in range(5)]
            for session_id in kept:
                await store.create_session(new_session(session_id))
            # Warm both pools: every pooled connection healthy when the hole opens.
            await asyncio.gather(*(store.get_session(s) for s in kept), store.ping())

            hole.silence()
            opened = time.monotonic()
            lost = unique("lost")

            async def timed(operation: object) -> float:
                started = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    await operation  # type: ignore[misc]
                return time.monotonic() - started

            waits = await asyncio.gather(
                *(timed(store.get_session(s)) for s in kept),
                timed(store.create_session(new_session(lost))),
                timed(store.ping()),
                timed(store.renew_lease("turn_x", REPLICA, T0 + timedelta(seconds=15))),
            )
            assert max(waits) <= UNIT_TIMEOUT_S + SLACK_S, waits
            # The hole lasts; later units fail within their bound too.
            await asyncio.sleep(max(0.0, HOLE_S - (time.monotonic() - opened)))
            assert await timed(store.get_session(kept[0])) <= UNIT_TIMEOUT_S + SLACK_S

            hole.heal()
            healed = time.monotonic()
            await store.ping()
            sessions = [await store.get_session(s) for s in kept]
            back_s = time.monotonic() - healed
            assert back_s < UNIT_TIMEOUT_S, back_s
            # Nothing acknowledged lost; the write that failed in the hole never ran.
            assert all(s is not None for s in sessions)
            await database.units_of_work.drain(10)
            assert await store.get_session(lost) is None
            print(
                f"\nblack hole: units failed in {min(waits):.2f}-{max(waits):.2f} s "
                f"(deadline {UNIT_TIMEOUT_S} s); back {back_s:.2f} s after the heal"
            )
        finally:
            await database.close(timeout_s=5)
