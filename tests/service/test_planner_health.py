"""Health follows the database, and start-up refuses a PostgreSQL schema that is behind.

Waits are on the health ``Watch`` stream (an event), bounded by a timeout; nothing
sleeps.
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.adapters.store import migrate
from service.server.root import LIVENESS_SERVICE, StartupError, start_planner
from tests.pg import PgCluster
from tests.service.planner_support import FakeTracker, planner_settings

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
async def tracker() -> AsyncIterator[FakeTracker]:
    fake = FakeTracker(projects={"demo": ("acme", {"alice"})})
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


async def wait_for_status(watch: grpc.aio.UnaryStreamCall, wanted: int, timeout_s: float) -> None:
    async def read() -> None:
        async for response in watch:
            if response.status == wanted:
                return
        raise AssertionError("the health stream ended")

    await asyncio.wait_for(read(), timeout_s)


@pytest.mark.postgres
async def test_health_follows_the_database_without_a_restart(
    own_pg_cluster: PgCluster, tracker: FakeTracker, tmp_path: Path
) -> None:
    name = f"planner_{uuid.uuid4().hex[:12]}"
    own_pg_cluster.create_database(name)
    url = own_pg_cluster.url(name)
    await migrate(url)
    settings = planner_settings(
        tmp_path, tracker.address, url, server__health_check_interval_s="0.2"
    )
    app = await start_planner(settings)
    channel = grpc.aio.insecure_channel(app.address)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(
            health_pb2.HealthCheckRequest(service="ballet.planner.v1.PlannerService")
        )
        await wait_for_status(watch, SERVING, 10)
        await asyncio.to_thread(own_pg_cluster.stop, "fast")
        await wait_for_status(watch, NOT_SERVING, 20)
        overall = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert overall.status == NOT_SERVING
        # Liveness probes ask "liveness": the process serves, so no restart (0163).
        alive = await health.Check(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE))
        assert alive.status == SERVING
        await asyncio.to_thread(own_pg_cluster.start)
        await wait_for_status(watch, SERVING, 30)
        overall = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert overall.status == SERVING
        watch.cancel()
    finally:
        await channel.close()
        await app.stop(0)


@pytest.mark.postgres
async def test_start_refuses_a_postgresql_schema_that_is_behind(
    pg_url: str, tracker: FakeTracker, tmp_path: Path
) -> None:
    settings = planner_settings(tmp_path, tracker.address, pg_url)
    with pytest.raises(StartupError, match="ballet-planner migrate"):
        await start_planner(settings)
    await migrate(pg_url)
    app = await start_planner(settings)
    await app.stop(0)


async def test_shutdown_turns_health_not_serving_first(
    tracker: FakeTracker, tmp_path: Path
) -> None:
    app = await start_planner(planner_settings(tmp_path, tracker.address))
    channel = grpc.aio.insecure_channel(app.address)
    try:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        await wait_for_status(watch, SERVING, 10)
        stopping = asyncio.ensure_future(app.stop(1.0))
        await wait_for_status(watch, NOT_SERVING, 5)
        started = asyncio.get_running_loop().time()
        await stopping
        assert asyncio.get_running_loop().time() - started < 1.0
    finally:
        await channel.close()
        await app.stop(0)


async def test_a_second_planner_on_a_port_in_use_is_refused(
    tracker: FakeTracker, tmp_path: Path
) -> None:
    # gRPC's default SO_REUSEPORT would let both bind and split the traffic silently.
    first = await start_planner(planner_settings(tmp_path / "a", tracker.address))
    try:
        port = first.address.rsplit(":", 1)[1]
        second = planner_settings(
            tmp_path / "b",
            tracker.address,
            SERVER__ADDRESS=f"127.0.0.1:{port}",
            SERVER__METRICS_ADDRESS="",
        )
        with pytest.raises(StartupError, match="is in use"):
            await start_planner(second)
    finally:
        await first.stop(0)


@pytest.mark.parametrize(
    ("address", "said"),
    [
        # A port in use wants another port...
        ("in use", "choose a free address"),
        # ...a host that does not resolve wants another host, not another port.
        ("no-such-host.invalid:9464", "give an address of this machine, e.g. 127.0.0.1:9464"),
    ],
)
async def test_a_metrics_address_that_cannot_be_bound_says_what_to_change(
    tracker: FakeTracker, tmp_path: Path, address: str, said: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        if address == "in use":
            address = f"127.0.0.1:{taken.getsockname()[1]}"
        settings = planner_settings(tmp_path, tracker.address, SERVER__METRICS_ADDRESS=address)
        with pytest.raises(StartupError, match=r"server\.metrics_address") as raised:
            await start_planner(settings)
    assert said in str(raised.value)
