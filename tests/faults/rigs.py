"""Two planners on a PostgreSQL in a network namespace of its own (decision 0315):
``silent_rig`` starts ``tests.replicas.support.rig`` on ``net.silent_database()`` with
the suite's shortened database bounds, and yields the rig and the namespace to cut;
``let_go`` checks how a cut replica ended a client's stream (decision 0314)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import grpc

from ballet_common.grpc.status import parse
from tests.faults.net import Namespace, silent_database
from tests.replicas.support import ChatStream, Rig, rig, sequences

#: Shortened database bounds (the defaults are 10 s, 8 s, 5/2 s, 5 s, 10 s; the
#: mechanism is the same).
DATABASE: dict[str, object] = {
    "unit_timeout_s": 3.0,
    "tcp_user_timeout_s": 2.0,
    "keepalives_idle_s": 1,
    "keepalives_interval_s": 1,
    "connect_timeout_s": 2,
    "pool_timeout_s": 3.0,
}


@asynccontextmanager
async def silent_rig(
    tmp_path: Path,
    scenario: object,
    *,
    planner: Mapping[str, object],
    split: bool = False,
) -> AsyncIterator[tuple[Rig, Namespace]]:
    """The rig on a database that ``net.silence()`` makes silent for both replicas; with
    ``split``, B reaches it by the namespace's other address, so ``net.cut(net.inner_ip)``
    cuts A alone."""
    with silent_database() as (cluster, net):
        async with rig(
            tmp_path,
            cluster.url("postgres"),
            scenario,
            planner=planner,
            database=DATABASE,
            b_database_url=cluster.url("postgres", net.other_ip) if split else None,
        ) as r:
            yield r, net


def let_go(stream: ChatStream, session_id: str) -> int:
    """Check that ``stream`` (ended) was let go by a cut replica: ``UNAVAILABLE``/
    ``REPLICA_UNAVAILABLE`` with its ``session_id`` and the ``last_sequence`` it
    delivered, every event up to it received once, in order. Returns ``last_sequence``,
    the ``after_sequence`` to reopen with."""
    assert isinstance(stream.error, grpc.aio.AioRpcError), stream.error
    failure = parse(stream.error)
    assert failure.code is grpc.StatusCode.UNAVAILABLE, failure
    assert failure.reason == "REPLICA_UNAVAILABLE", failure
    assert failure.metadata["session_id"] == session_id, failure
    last = int(failure.metadata["last_sequence"])
    assert sequences(stream.events()) == list(range(1, last + 1))
    return last
