"""A NOTIFY stalled elsewhere in the cluster, for the tests of cross-replica signals.

PostgreSQL serializes the commits of transactions that NOTIFY under one cluster-wide
lock, held until the commit is complete, synchronous replication included. A cluster
whose ``synchronous_standby_names`` names a standby that never connects makes a commit
with ``synchronous_commit = on`` wait forever; if that transaction wrote something (a
commit record to replicate) and notified, it holds the lock all that time, and every
other NOTIFYing commit in the cluster (a bare ``SELECT pg_notify(...)`` included) waits
behind it, while plain commits go on. Notifications queued after it reach no listener
either until it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import psycopg

from tests.pg import PgCluster


def durable_stalling_cluster(cluster: PgCluster) -> None:
    """Configure and start ``cluster`` with durable commits (fsync, full page writes,
    commits flushed locally) and a synchronous standby that never comes."""
    cluster.configure(
        {
            "fsync": "on",
            "full_page_writes": "on",
            "synchronous_commit": "local",
            "synchronous_standby_names": "'no_such_standby'",
        }
    )
    cluster.start()


def _conninfo(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


@contextlib.asynccontextmanager
async def stalled_notify(url: str) -> AsyncIterator[None]:
    """Hold a NOTIFYing commit on ``url``'s cluster (``durable_stalling_cluster``) for the
    block; returns once the stall is verified: the commit waits for the standby, and a
    bare ``NOTIFY`` elsewhere times out on the lock. Ends it on leaving."""
    staller = await psycopg.AsyncConnection.connect(_conninfo(url), autocommit=True)
    probe = await psycopg.AsyncConnection.connect(_conninfo(url), autocommit=True)
    commit: asyncio.Future[object] | None = None
    try:
        await staller.execute("CREATE TABLE IF NOT EXISTS stall_marks (x int)")
        await staller.execute("SET synchronous_commit = on")
        commit = asyncio.ensure_future(
            staller.execute(
                "BEGIN; INSERT INTO stall_marks VALUES (1); SELECT pg_notify('x', 'y'); COMMIT"
            )
        )
        for _ in range(200):
            cursor = await probe.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
            )
            row = await cursor.fetchone()
            if row is not None and row[0]:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the NOTIFYing commit did not stall")
        try:
            await probe.execute(
                "SELECT set_config('lock_timeout', '200ms', true), pg_notify('probe', '')"
            )
        except psycopg.errors.LockNotAvailable:
            pass
        else:
            raise AssertionError("a NOTIFY went through despite the stall")
        yield
        assert not commit.done(), "the stalled commit ended early"
    finally:
        if commit is not None:
            commit.cancel()
            with contextlib.suppress(BaseException):
                await commit
        await probe.close()
        await staller.close()
