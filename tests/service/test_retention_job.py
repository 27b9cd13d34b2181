"""``serve``'s retention job in a running planner, on SQLite and PostgreSQL
(docs/retention.md): off by default; on, it deletes an idle session at its first pass,
ends the Chat stream attached to it ``NOT_FOUND``, leaves a session in use, and counts
what it deleted on the planner's ``/metrics``."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from ballet.planner.v1 import chat_pb2, planner_service_pb2, planner_service_pb2_grpc

from service.adapters.store import SqlSessionStore, make_engine, migrate
from service.server.root import start_planner
from tests.integration.store_support import end_commit, new_session, turn_start
from tests.service.planner_support import (
    FakeTracker,
    auth,
    planner_settings,
    reason_of,
    token,
)

LONG_AGO = datetime(2025, 1, 6, 9, 30, tzinfo=UTC)


@pytest.fixture(params=["sqlite", "postgresql"])
async def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "postgresql":
        url: str = request.getfixturevalue("pg_url")
    else:
        url = f"sqlite+aiosqlite:///{tmp_path / 'planner.db'}"
    await migrate(url)
    yield url


async def plant_idle(url: str, session_id: str, *, running: bool) -> SqlSessionStore:
    """An idle session of alice in project demo, last active long ago; with ``running``
    its turn is left running (a lease nobody sweeps) until the test ends it."""
    engine = make_engine(url)
    store = SqlSessionStore(engine, "planter")
    await store.create_session(new_session(session_id, owner="alice", project="demo", now=LONG_AGO))
    start = turn_start(
        session_id,
        f"{session_id}-t",
        project="demo",
        owner="planter",
        now=LONG_AGO,
        lease=timedelta(days=3650),
    )
    await store.start_turn(start)
    if not running:
        await store.commit(end_commit(session_id, f"{session_id}-t", now=LONG_AGO, owner="planter"))
    return store


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        text: str = response.read().decode()
        return text


def sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not exported")


async def test_retention_is_off_by_default(tmp_path: Path, database_url: str) -> None:
    tracker = FakeTracker(projects={"demo": ("acme", {"alice"})})
    await tracker.start()
    store = await plant_idle(database_url, "idle-1", running=False)
    app = await start_planner(planner_settings(tmp_path / "data", tracker.address, database_url))
    try:
        metrics = scrape(app.metrics_address)
        assert sample(metrics, 'ballet_planner_retention_passes_total{outcome="completed"}') == 0
        assert await store.get_session("idle-1") is not None
    finally:
        await app.stop(0)
        await tracker.stop()


async def test_the_job_deletes_idle_sessions_and_ends_their_streams(
    tmp_path: Path, database_url: str
) -> None:
    tracker = FakeTracker(projects={"demo": ("acme", {"alice"})})
    await tracker.start()
    # Running while the stream attaches (a running turn keeps its session), then ended
    # with its old time: idle from then on.
    store = await plant_idle(database_url, "idle-1", running=True)
    settings = planner_settings(
        tmp_path / "data",
        tracker.address,
        database_url,
        RETENTION__SESSION_IDLE_DAYS="30",
        RETENTION__INTERVAL_S="1",
        RETENTION__BATCH_PAUSE_S="0",
    )
    app = await start_planner(settings)
    channel = grpc.aio.insecure_channel(app.address)
    alice = auth(token(tmp_path / "data", "alice"))
    done = asyncio.Event()
    try:
        stub = planner_service_pb2_grpc.PlannerServiceStub(channel)
        in_use = await stub.CreateSession(
            planner_service_pb2.CreateSessionRequest(project_id="demo", request_id="c-1"),
            metadata=alice,
        )

        async def requests() -> AsyncIterator[chat_pb2.ChatRequest]:
            yield chat_pb2.ChatRequest(open=chat_pb2.OpenAction(session_id="idle-1"))
            await done.wait()  # the client keeps its side open

        call = stub.Chat(requests(), metadata=alice)
        first = await call.read()
        assert first.WhichOneof("event") == "session_opened"
        await store.commit(end_commit("idle-1", "idle-1-t", now=LONG_AGO, owner="planter"))

        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while True:
                response = await call.read()
                assert response is not grpc.aio.EOF, "the stream ended without an error"
        assert ended.value.code() == grpc.StatusCode.NOT_FOUND
        assert reason_of(ended.value) == "SESSION_NOT_FOUND"
        assert await store.get_session("idle-1") is None
        assert await store.get_session(in_use.session.session_id) is not None

        deadline = time.monotonic() + 10
        while True:
            metrics = scrape(app.metrics_address)
            deleted = sample(
                metrics, 'ballet_planner_retention_sessions_deleted_total{reason="idle"}'
            )
            if deleted == 1 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)  # the stream ends just before the count is kept
        assert deleted == 1
        assert (
            sample(metrics, 'ballet_planner_retention_messages_deleted_total{reason="idle"}') == 1
        )
        assert sample(metrics, "ballet_planner_retention_last_completed_pass_timestamp_seconds") > 0
    finally:
        done.set()
        await channel.close()
        await app.stop(0)
        await tracker.stop()
