"""SIGTERM while a write tool is held (docs/spec/turn-loop.md and docs/spec/operations.md; decision
0181).

A ``ballet-planner serve`` process on PostgreSQL with the devstack, which holds
``CreateKnowledgeEntry`` (fault injection) so the turn's write never answers. On SIGTERM
the process reports NOT_SERVING, ends at once the stream that waits for nothing, gives
the write its ``planner.cancel_grace``, stores the turn ``INTERRUPTED`` with the write's
result "interrupted; the outcome is unknown", sends ``turn_ended`` to the stream that
runs it and then ends that stream ``UNAVAILABLE``/``SHUTTING_DOWN``, and exits 0 within
``server.grace_s``. The database is read after the process exited: nothing else could
have closed the turn (there is no other replica, and its lease outlives the test).
"""

from __future__ import annotations

import json
import math
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from ballet.planner.v1 import planner_service_pb2_grpc
from ballet.planner.v1 import resources_pb2 as res
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import text

from service.adapters.store import make_engine
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

pytestmark = pytest.mark.postgres

CANCEL_GRACE_S = 1.0
GRACE_S = 4.0
NOTE = {"kind": "note", "title": "Shutdown", "body": "Written while the replica stopped."}
RULES = [
    {
        "match": {"last_role": "human", "last_text_regex": "record"},
        "reply": {"tool_calls": [{"name": "create_knowledge", "arguments": NOTE}]},
    },
    {
        "match": {"last_role": "human", "last_text_regex": "epics"},
        "reply": {"tool_calls": [{"name": "list_items", "arguments": {"kind": "epic"}}]},
    },
    {"match": {"last_role": "tool"}, "reply": {"text": "Recorded."}},
    {"reply": {"text": "Hello."}},
]


@pytest.fixture
async def stack(tmp_path: Path, pg_url: str) -> AsyncIterator[Stack]:
    started = await start_stack(tmp_path / "data", RULES, database_url=pg_url)
    try:
        yield started
    finally:
        await started.stop()


async def test_sigterm_while_a_write_is_held_interrupts_the_turn_before_exit(
    stack: Stack,
    tmp_path: Path,
    pg_url: str,
    record_property: Callable[[str, object], None],
) -> None:
    served = await serve_process(
        stack,
        tmp_path / "serve.log",
        SERVER__GRACE_S=str(GRACE_S),
        PLANNER__CANCEL_GRACE=str(CANCEL_GRACE_S),
        PLANNER__LEASE_S="600",
        LOGGING__LEVEL="INFO",
    )
    try:
        async with grpc.aio.insecure_channel(served.address) as channel:
            stub = planner_service_pb2_grpc.PlannerServiceStub(channel)
            running = Chat(stub, stack.auth())
            await running.open(project_id="demo")
            idle = Chat(stub, stack.auth())
            await idle.open(project_id="demo")
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await within(watch.read())).status == health_pb2.HealthCheckResponse.SERVING

            stack.devstack.faults.set(method="CreateKnowledgeEntry", delay_s=math.inf)
            await running.send(send_request("please record a note", "send-1"))
            accepted = await running.until("message_accepted")
            await stack.devstack.call_log.wait_for(
                lambda log: log.started("CreateKnowledgeEntry") == 1, WAIT_S
            )

            signalled = time.monotonic()
            served.process.send_signal(signal.SIGTERM)
            status = (await within(watch.read())).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING

            # The stream that waits for nothing ends at once, with the shutdown reason.
            error = await idle.ended()
            assert error is not None
            assert failure(error)[:2] == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")
            idle_ended_s = time.monotonic() - signalled

            # The running stream gets the turn's end, then the shutdown reason.
            ended = await running.until("turn_ended", turn_id=accepted.turn_id)
            assert ended.turn_ended.reason == res.TURN_END_REASON_INTERRUPTED
            error = await running.ended()
            assert error is not None
            assert failure(error)[:2] == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")

        code = served.process.wait(GRACE_S + WAIT_S)
        exited_s = time.monotonic() - signalled
    finally:
        stack.devstack.faults.clear()
        served.stop()
    record_property("idle_stream_ended_after_sigterm_s", round(idle_ended_s, 3))
    record_property("exited_after_sigterm_s", round(exited_s, 3))
    assert code == 0, served.log()

    engine = make_engine(pg_url)
    try:
        async with engine.connect() as conn:
            turn = (
                await conn.execute(
                    text(
                        "SELECT state, end_reason, error_reason, error_message FROM turns "
                        "WHERE turn_id = :turn_id"
                    ),
                    {"turn_id": accepted.turn_id},
                )
            ).one()
            results = (
                await conn.execute(
                    text(
                        "SELECT tool_name, tool_result FROM messages WHERE turn_id = :turn_id "
                        "AND kind = 'tool_result'"
                    ),
                    {"turn_id": accepted.turn_id},
                )
            ).all()
            turn_ended = (
                await conn.execute(
                    text(
                        "SELECT count(*) FROM session_events WHERE turn_id = :turn_id "
                        "AND kind = 'turn_ended'"
                    ),
                    {"turn_id": accepted.turn_id},
                )
            ).scalar_one()
    finally:
        await engine.dispose()
    assert tuple(turn) == (
        "ended",
        "interrupted",
        "INTERRUPTED",
        "the planner is shutting down",
    )
    assert [(name, json.loads(result)["error"]["message"]) for name, result in results] == [
        ("create_knowledge", "interrupted; the outcome is unknown")
    ]
    assert turn_ended == 1
    log = served.log()
    assert "Traceback" not in log and "garbage collector" not in log


async def test_sigterm_closes_a_stream_once_its_turn_ended_while_another_turn_runs_on(
    stack: Stack, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """Decision 0181: a stream is closed as soon as nothing more will be sent on it, not
    when the replica's slowest turn ends."""
    grace_s = 12.0
    served = await serve_process(
        stack,
        tmp_path / "serve.log",
        SERVER__GRACE_S=str(grace_s),
        PLANNER__CANCEL_GRACE=str(CANCEL_GRACE_S),
        PLANNER__LEASE_S="600",
    )
    try:
        async with grpc.aio.insecure_channel(served.address) as channel:
            stub = planner_service_pb2_grpc.PlannerServiceStub(channel)
            slow = Chat(stub, stack.auth())
            await slow.open(project_id="demo")
            quick = Chat(stub, stack.auth())
            await quick.open(project_id="demo")
            # The slow turn's write never answers: it runs until the grace period ends.
            stack.devstack.faults.set(method="CreateKnowledgeEntry", delay_s=math.inf)
            # The quick turn is still running at SIGTERM and ends a moment later.
            stack.devstack.faults.set(method="ListItems", delay_s=2.0)
            await slow.send(send_request("please record a note", "slow-1"))
            slow_turn = (await slow.until("message_accepted")).turn_id
            await quick.send(send_request("what are the epics?", "quick-1"))
            await stack.devstack.call_log.wait_for(
                lambda log: (
                    log.started("CreateKnowledgeEntry") == 1 and log.started("ListItems") == 1
                ),
                WAIT_S,
            )
            served.process.send_signal(signal.SIGTERM)

            ended = await quick.until("turn_ended")
            turn_ended_at = time.monotonic()
            assert ended.turn_ended.reason == res.TURN_END_REASON_COMPLETED
            error = await quick.ended()
            closed_s = time.monotonic() - turn_ended_at
            assert error is not None
            assert failure(error)[:2] == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")
            # The slow turn runs on: its stream is still waiting for its end.
            assert served.process.poll() is None
            slow_ended = await slow.until("turn_ended", turn_id=slow_turn)
            assert slow_ended.turn_ended.reason == res.TURN_END_REASON_INTERRUPTED
        code = served.process.wait(grace_s + WAIT_S)
    finally:
        stack.devstack.faults.clear()
        served.stop()
    record_property("stream_closed_after_its_turn_ended_s", round(closed_s, 3))
    assert closed_s < 3.0
    assert code == 0, served.log()
