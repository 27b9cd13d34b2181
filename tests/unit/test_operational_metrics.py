"""The metrics the alerting rules read (deploy/prometheus/; decision 0240), counted where
they happen: a turn's time to first delta, failed turns by reason, failed units of work
by kind. With the in-memory fakes and a real ``Metrics`` registry (no I/O)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from psycopg_pool import PoolTimeout
from sqlalchemy import exc as sa_exc

from service.adapters.store.work import FAILURE_KINDS, UnitsOfWork, failure_kind
from service.core.errors import (
    FailedPrecondition,
    ModelFailure,
    StoreConflict,
    StoreUnavailable,
)
from service.core.model import TurnEndReason
from service.core.ports import ModelRequest, Purpose, Role
from service.server.metrics import DATABASE_ERROR_KINDS, Metrics, bounded_reason
from service.server.observer import PrometheusTurnObserver
from tests.unit.fakes import last_role
from tests.unit.test_turn import make_rig


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


class Planner:
    """The turn service over the fakes (``tests.unit.test_turn``'s rig) whose observer
    records into a real ``Metrics``."""

    def __init__(self, script: Any, **settings: Any) -> None:
        self.metrics = Metrics()
        self.rig = make_rig(script, observer=PrometheusTurnObserver(self.metrics), **settings)
        self.clock = self.rig.clock

    async def run(self, text: str) -> None:
        await self.rig.run(text)


def test_every_turn_end_reason_and_database_error_kind_is_exported_from_the_start() -> None:
    # A counter that appears with its first increment hides that increment from rate();
    # bounded label sets are exported at 0 instead (the alerting rules rely on
    # turns_total{reason="interrupted"} existing).
    metrics = Metrics()
    for reason in TurnEndReason:
        assert sample(metrics, "ballet_planner_turns_total", reason=reason.value) == 0
    assert DATABASE_ERROR_KINDS == FAILURE_KINDS
    for kind in DATABASE_ERROR_KINDS:
        assert sample(metrics, "ballet_planner_database_errors_total", kind=kind) == 0


async def test_the_first_delta_is_timed_once_per_turn_from_its_start() -> None:
    # 1.5 s pass before the model's first answer (a tool call, whose start is the first
    # delta the client sees); the final answer's text comes later and is not counted.
    def script(request: ModelRequest) -> dict[str, Any]:
        if last_role(request) is Role.USER:
            planner.clock.advance(1.5)
            return {"tool_calls": [("list_items", "{}")]}
        planner.clock.advance(3.0)
        return {"chunks": ["Here ", "they ", "are."]}

    planner = Planner(script)
    await planner.run("list the items")
    name = "ballet_planner_turn_first_delta_seconds"
    assert sample(planner.metrics, f"{name}_count") == 1
    assert sample(planner.metrics, f"{name}_sum") == pytest.approx(1.5)
    assert sample(planner.metrics, f"{name}_bucket", le="1.0") == 0
    assert sample(planner.metrics, f"{name}_bucket", le="1.5") == 1
    assert sample(planner.metrics, "ballet_planner_turns_total", reason="completed") == 1


async def test_a_compaction_call_streams_no_delta_to_time() -> None:
    # The compaction call is not relayed: the first delta is the turn's own answer.
    def script(request: ModelRequest) -> dict[str, Any]:
        planner.clock.advance(2.0)
        if request.purpose is Purpose.COMPACTION:
            return {"text": "SUMMARY", "usage": (100, 10)}
        return {"chunks": ["Hello"], "usage": (5000, 10)}

    planner = Planner(script, compact_at_tokens=1000)
    await planner.run("one")
    await planner.run("two")  # over the threshold: compacts first, then answers
    assert sample(planner.metrics, "ballet_planner_compactions_total") == 1
    name = "ballet_planner_turn_first_delta_seconds"
    assert sample(planner.metrics, f"{name}_count") == 2
    # The second turn's answer came after the compaction's 2 s and its own 2 s.
    assert sample(planner.metrics, f"{name}_sum") == pytest.approx(2.0 + 4.0)


async def test_a_failed_turn_is_counted_by_its_error_reason_and_streams_no_delta() -> None:
    def script(request: ModelRequest) -> dict[str, Any]:
        return {"error": ModelFailure("MODEL_UNAVAILABLE", "gone")}

    planner = Planner(script)
    await planner.run("hello")
    await planner.run("again")
    assert sample(planner.metrics, "ballet_planner_turns_total", reason="failed") == 2
    assert (
        sample(planner.metrics, "ballet_planner_turn_failures_total", reason="MODEL_UNAVAILABLE")
        == 2
    )
    assert sample(planner.metrics, "ballet_planner_turn_first_delta_seconds_count") == 0


def test_only_failed_turns_count_as_failures_and_reasons_stay_bounded() -> None:
    metrics = Metrics()
    observer = PrometheusTurnObserver(metrics)
    observer.turn_ended(TurnEndReason.INTERRUPTED, "INTERRUPTED")
    observer.turn_ended(TurnEndReason.COMPLETED, "")
    observer.turn_ended(TurnEndReason.FAILED, "the model said no: session s-123")
    observer.turn_ended(TurnEndReason.FAILED, "")
    failures = "ballet_planner_turn_failures_total"
    assert sample(metrics, failures, reason="INTERRUPTED") is None
    assert sample(metrics, failures, reason="OTHER") == 2
    assert bounded_reason("TOO_MANY_STREAMS") == "TOO_MANY_STREAMS"
    for bad in ("", "lower", "A" * 65, "SPACE D", "NAME-WITH-DASH"):
        assert bounded_reason(bad) == "OTHER"


def test_the_kind_of_a_failed_unit_of_work() -> None:
    def caused(error: StoreUnavailable, cause: BaseException) -> StoreUnavailable:
        error.__cause__ = cause
        return error

    pool = caused(StoreUnavailable("no connection free"), PoolTimeout("timeout"))
    queue = caused(StoreUnavailable("no connection free"), sa_exc.TimeoutError("QueuePool"))
    assert failure_kind(pool) == failure_kind(queue) == "pool_timeout"
    assert failure_kind(StoreUnavailable("the database is unavailable")) == "unavailable"
    assert failure_kind(RuntimeError("a bug")) == "unexpected"
    # The store's answers are not database errors.
    assert failure_kind(StoreConflict("lost the race")) is None
    assert failure_kind(FailedPrecondition("running", reason="TURN_IN_PROGRESS")) is None


async def test_every_failed_unit_of_work_is_reported_even_when_its_caller_left() -> None:
    units = UnitsOfWork()
    kinds: list[str] = []
    units.on_failure(kinds.append)
    release = asyncio.Event()

    async def unavailable() -> None:
        raise StoreUnavailable("down")

    async def conflict() -> None:
        raise StoreConflict("lost")

    async def ok() -> int:
        return 1

    async def late_bug() -> None:
        await release.wait()
        raise RuntimeError("a bug")

    with pytest.raises(StoreUnavailable):
        await units.run(unavailable())
    with pytest.raises(StoreConflict):
        await units.run(conflict())
    assert await units.run(ok()) == 1
    caller = asyncio.get_running_loop().create_task(units.run(late_bug()))
    await asyncio.sleep(0)
    caller.cancel()
    await asyncio.wait({caller})
    release.set()
    await units.drain(5)
    assert kinds == ["unavailable", "unexpected"]
