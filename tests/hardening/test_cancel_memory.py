"""10,000 cancelled turns leave the planner's memory flat and no connection checked out.

A ``ballet-planner serve`` process on PostgreSQL runs against the devstack, whose
scripted model never answers: every model call sleeps until the planner cancels it.
Four workers (alice's four running turns, docs/spec/storage.md) each drive one Chat stream: send a
message, wait until the model call is in flight, cancel the turn, read its
``turn_ended``, again; every 100 turns a worker moves to a new session, so no session's
history grows without bound. The planner's RSS (``/proc/<pid>/status``) after the last
turn must be within 5% of its level after the first 1,000; then no pooled connection is
checked out (the planner's ``ballet_planner_database_connections_in_use`` gauge) and
PostgreSQL sees none of the planner's connections active or in a transaction.

Knowing that a model call is in flight needs no polling: the scripted provider's sleep
is a hook that tells the worker whose rule it runs (each worker's rule sleeps a slightly
different time), then sleeps until it is cancelled.
"""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from ballet.planner.v1 import planner_service_pb2_grpc, resources_pb2
from sqlalchemy import text

from devstack.gateway import ScriptedProvider
from service.adapters.store import make_engine
from tests.hardening.support import (
    Chat,
    PlannerProcess,
    Stack,
    cancel_request,
    eventually,
    send_request,
    serve_process,
    start_stack,
)

# About 135 s on an idle 2-core machine (the planner is CPU-bound at about 13 ms per
# cancelled turn, 74 turns/s); the bounds below leave room for a busy one.
pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(600)]

TURNS = 10_000
BASELINE_AFTER = 1_000
WORKERS = 4
TURNS_PER_SESSION = 100
#: A worker's model call sleeps BASE_MS + its index: the hook tells them apart by it.
BASE_MS = 3_600_000


class ModelGate:
    """The scripted provider's sleep: records which worker's model call is in flight,
    then sleeps until the planner cancels the call."""

    def __init__(self) -> None:
        self.entered = [asyncio.Event() for _ in range(WORKERS)]

    async def sleep(self, seconds: float) -> None:
        worker = round(seconds * 1000) - BASE_MS
        if 0 <= worker < WORKERS:
            self.entered[worker].set()
        await asyncio.sleep(seconds)


def rules() -> list[dict[str, Any]]:
    return [
        {
            "match": {"last_text_regex": f"^worker {index} "},
            "reply": {"text": "never sent", "delay_ms": BASE_MS + index},
        }
        for index in range(WORKERS)
    ]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def no_connection_in_use(served: PlannerProcess) -> bool:
    """The planner's pool has no connection checked out (its metrics gauge)."""
    name = "ballet_planner_database_connections_in_use"
    return await asyncio.to_thread(gauge, served.metrics_address, name) == 0


def gauge(metrics_address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


@pytest.fixture
async def stack(tmp_path: Path, pg_url: str) -> AsyncIterator[tuple[Stack, ModelGate]]:
    gate = ModelGate()
    started = await start_stack(tmp_path / "data", rules(), database_url=pg_url)
    # The provider sleeps through the gate (a provider's sleep is fixed at creation).
    started.gateway.provider = ScriptedProvider({"rules": rules()}, sleep=gate.sleep)
    try:
        yield started, gate
    finally:
        await started.stop()


async def worker(
    index: int,
    stub: planner_service_pb2_grpc.PlannerServiceStub,
    stack: Stack,
    gate: ModelGate,
    counter: dict[str, int],
    milestone: asyncio.Event,
    resume: asyncio.Event,
) -> None:
    chat: Chat | None = None
    done = 0
    while True:
        if counter["started"] >= BASELINE_AFTER and not resume.is_set():
            # Everyone pauses at the baseline, so it is measured with nothing in flight.
            await resume.wait()
        if counter["started"] >= TURNS:
            break
        counter["started"] += 1
        if done % TURNS_PER_SESSION == 0:
            if chat is not None:
                await chat.close()
            chat = Chat(stub, stack.auth())
            await chat.open(project_id="demo", title=f"worker {index}")
        assert chat is not None
        entered = gate.entered[index]
        entered.clear()
        await chat.send(send_request(f"worker {index} turn {done}", f"w{index}-{done}"))
        await asyncio.wait_for(entered.wait(), 30)
        await chat.send(cancel_request())
        ended = await chat.until("turn_ended")
        assert ended.turn_ended.reason == resources_pb2.TURN_END_REASON_CANCELLED, ended
        done += 1
        counter["ended"] += 1
        if counter["ended"] == BASELINE_AFTER:
            milestone.set()
        if counter["ended"] % 1000 == 0:
            # The gateway keeps every request for tests to read; this one reads none.
            stack.gateway.reset()
    if chat is not None:
        await chat.close()


async def test_ten_thousand_cancelled_turns_leave_memory_flat_and_no_connection_in_use(
    stack: tuple[Stack, ModelGate], tmp_path: Path
) -> None:
    rig, gate = stack
    served: PlannerProcess = await serve_process(
        rig,
        tmp_path / "planner.log",
        SERVER__REPLICA_ID="memory",
        # A health ping every minute instead of every 2 s, so that the pool is not caught
        # mid-ping when it is measured.
        SERVER__HEALTH_CHECK_INTERVAL_S="60",
        # The sessions' contexts kept between turns are bounded (64 MiB by default); a
        # bound these sessions fill before the baseline keeps a full cache from reading
        # as growth (decision 0113).
        DATABASE__CONTEXT_CACHE_BYTES=str(1 << 20),
    )
    channel = grpc.aio.insecure_channel(served.address)
    try:
        stub = planner_service_pb2_grpc.PlannerServiceStub(channel)
        counter = {"started": 0, "ended": 0}
        milestone, resume = asyncio.Event(), asyncio.Event()
        started = time.monotonic()
        workers = [
            asyncio.create_task(worker(i, stub, rig, gate, counter, milestone, resume))
            for i in range(WORKERS)
        ]
        await asyncio.wait_for(milestone.wait(), 120)
        baseline = rss_kib(served.process.pid)
        resume.set()
        await asyncio.wait_for(asyncio.gather(*workers), 540)
        elapsed = time.monotonic() - started
        final = rss_kib(served.process.pid)
        print(
            f"\n{counter['ended']} cancelled turns in {elapsed:.1f} s "
            f"({counter['ended'] / elapsed:.0f}/s, planner CPU {cpu_s(served.process.pid):.1f} s); "
            f"RSS after {BASELINE_AFTER}: {baseline} KiB, after {counter['ended']}: {final} KiB "
            f"({(final - baseline) / baseline:+.1%})"
        )
        assert counter["ended"] == TURNS
        assert final <= baseline * 1.05, (baseline, final)
        # The last stream's row is deleted in the background as it closes: allow that
        # one unit of work to finish, then nothing may stay checked out.
        await eventually(lambda: no_connection_in_use(served), seconds=5)
        assert (
            await asyncio.to_thread(gauge, served.metrics_address, "ballet_planner_running_turns")
            == 0
        )
        engine = make_engine(rig.database_url, pool_size=1)
        try:
            async with engine.connect() as conn:
                busy = (
                    await conn.execute(
                        text(
                            "SELECT count(*) FROM pg_stat_activity WHERE datname ="
                            " current_database() AND pid <> pg_backend_pid()"
                            " AND application_name LIKE 'ballet-planner%'"
                            " AND state <> 'idle'"
                        )
                    )
                ).scalar_one()
                running = (
                    await conn.execute(text("SELECT count(*) FROM turns WHERE state = 'running'"))
                ).scalar_one()
        finally:
            await engine.dispose()
        assert (busy, running) == (0, 0)
    finally:
        await channel.close()
        served.stop()
