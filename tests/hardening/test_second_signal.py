"""A second SIGTERM while ``ballet-planner serve`` shuts down (decision 0185;
docs/spec/operations.md; decision 0181).

A real ``serve`` process on SQLite with the devstack, a turn streaming a slow answer. The
first SIGTERM starts the graceful stop (health NOT_SERVING; the turn would get 13 s to
end); the second one skips to the end: the turn is stopped and stored ``INTERRUPTED``,
the stream gets its ``turn_ended`` and then ``UNAVAILABLE``/``SHUTTING_DOWN``, and the
process exits 143 without a traceback or an ERROR line. The database is read after the
process exited.
"""

from __future__ import annotations

import signal
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from ballet.planner.v1 import planner_service_pb2_grpc
from ballet.planner.v1 import resources_pb2 as res
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.hardening.support import (
    WAIT_S,
    Chat,
    Stack,
    failure,
    send_request,
    serve_process,
    start_stack,
    within,
)

RULES = [{"reply": {"text": "Slowly. " * 100, "chunk_chars": 2, "delay_ms": 250}}]


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    started = await start_stack(tmp_path / "data", RULES)
    try:
        yield started
    finally:
        await started.stop()


async def test_a_second_sigterm_interrupts_the_turn_and_exits_143(
    stack: Stack, tmp_path: Path
) -> None:
    served = await serve_process(stack, tmp_path / "serve.log", LOGGING__LEVEL="INFO")
    try:
        async with grpc.aio.insecure_channel(served.address) as channel:
            stub = planner_service_pb2_grpc.PlannerServiceStub(channel)
            running = Chat(stub, stack.auth())
            await running.open(project_id="demo")
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await within(watch.read())).status == health_pb2.HealthCheckResponse.SERVING
            await running.send(send_request("tell me slowly", "send-1"))
            accepted = await running.until("message_accepted")
            await running.until("text_delta")

            served.process.send_signal(signal.SIGTERM)
            status = (await within(watch.read())).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            served.process.send_signal(signal.SIGTERM)

            ended = await running.until("turn_ended", turn_id=accepted.turn_id)
            assert ended.turn_ended.reason == res.TURN_END_REASON_INTERRUPTED
            error = await running.ended()
            assert error is not None
            assert failure(error)[:2] == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")
        code = served.process.wait(WAIT_S)
    finally:
        served.stop()
    log = served.log()
    assert code == 128 + signal.SIGTERM, log
    assert "shutting down at once" in log
    for sign in ("Traceback", "Segmentation fault", '"level": "ERROR"'):
        assert sign not in log, log
    with sqlite3.connect(stack.data_dir / "planner.db") as connection:
        turns = connection.execute("SELECT turn_id, state, end_reason FROM turns").fetchall()
    assert turns == [(accepted.turn_id, "ended", "interrupted")]
