"""The retention rules of ``service/core/retention.py`` with an in-memory store: how a
pass splits its work into batches, stops when it lost its lock or the job stops, and what
the background job reports. The SQL side is ``tests/integration/test_retention.py``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import pytest

from service.core.errors import StoreUnavailable
from service.core.retention import (
    Candidate,
    Deleted,
    LockCheck,
    PassOutcome,
    PurgeBounds,
    Purger,
    PurgeReason,
    RetentionJob,
    Window,
    batches,
    idle_cutoff,
)
from service.server.metrics import Metrics
from service.server.retention import PrometheusPurgeObserver

T = TypeVar("T")
NOW = datetime(2026, 6, 1, tzinfo=UTC)
OLD = NOW - timedelta(days=400)


class Clock:
    def now(self) -> datetime:
        return NOW

    def monotonic(self) -> float:
        return time.monotonic()


class MemoryStore:
    """Sessions as candidates in a list, a pass lock another process may hold, and the
    lock's check, which a test can make fail."""

    def __init__(self, candidates: Sequence[Candidate]) -> None:
        self.candidates = list(candidates)
        self.locked_elsewhere = False
        self.lock_alive = True
        self.batches: list[list[str]] = []
        self.fail_windows = False
        self.before_delete: Callable[[], None] = lambda: None

    async def exclusively(self, work: Callable[[LockCheck], Awaitable[T]]) -> T | None:
        if self.locked_elsewhere:
            return None

        async def held() -> bool:
            return self.lock_alive

        return await work(held)

    async def idle_window(self, idle_before: datetime, after: object | None, limit: int) -> Window:
        if self.fail_windows:
            raise StoreUnavailable("down")
        start = 0 if after is None else int(str(after))
        rows = self.candidates[start : start + limit]
        more = start + limit < len(self.candidates)
        return Window(tuple(rows), start + limit if more else None)

    async def human_window(self, human_id: str, after: object | None, limit: int) -> Window:
        return await self.idle_window(NOW, after, limit)

    async def delete_sessions(
        self,
        session_ids: Sequence[str],
        *,
        idle_before: datetime | None = None,
        owner_id: str | None = None,
    ) -> Deleted:
        self.before_delete()
        self.batches.append(list(session_ids))
        return Deleted(tuple(session_ids), 2 * len(session_ids))

    async def count_messages(self, session_ids: Sequence[str]) -> int:
        return 2 * len(session_ids)

    async def running_turns_of(self, human_id: str) -> list[str]:
        return []

    async def count_sessions_of(self, human_id: str) -> int:
        return 0

    async def stream_slots_of(self, human_id: str, *, delete: bool) -> int:
        return 0


class NoSessions:
    """The ``SessionStore`` part retention uses: cancels, which nothing here needs."""

    async def request_cancel(self, turn_id: str) -> None:
        raise AssertionError("no turn runs here")


def old(name: str, events: int = 4, *, running: bool = False) -> Candidate:
    return Candidate(name, OLD, events, running)


async def no_pause(seconds: float) -> None:
    return None


def purger(store: MemoryStore, bounds: PurgeBounds | None = None, **kwargs: Any) -> Purger:
    return Purger(
        store,
        NoSessions(),  # type: ignore[arg-type]
        Clock(),
        bounds or PurgeBounds(pause_s=0),
        sleep=no_pause,
        **kwargs,
    )


def test_batches_hold_at_most_their_sessions_and_events() -> None:
    made = batches(
        [old("a", 3), old("b", 3), old("c", 3), old("d", 20), old("e", 1), old("f", 1)],
        PurgeBounds(max_sessions=2, max_events=7),
    )
    assert [[c.session_id for c in batch] for batch in made] == [
        ["a", "b"],
        ["c"],
        ["d"],  # larger than max_events: alone
        ["e", "f"],
    ]
    assert batches([], PurgeBounds()) == []


def test_the_bounds_and_the_idle_days_are_checked() -> None:
    with pytest.raises(ValueError):
        PurgeBounds(max_sessions=0)
    with pytest.raises(ValueError):
        PurgeBounds(pause_s=-1)
    with pytest.raises(ValueError):
        idle_cutoff(NOW, 0)
    assert idle_cutoff(NOW, 30) == NOW - timedelta(days=30)


async def test_a_pass_leaves_running_and_recent_sessions_to_the_store_untouched() -> None:
    recent = Candidate("recent", NOW - timedelta(days=1), 4, running=False)
    store = MemoryStore([old("a"), recent, old("busy", running=True), old("b")])
    report = await purger(store).purge_idle(30)
    assert store.batches == [["a", "b"]]
    assert (report.sessions, report.messages, report.batches) == (2, 4, 1)


async def test_a_pass_that_lost_its_lock_stops_before_its_next_batch() -> None:
    store = MemoryStore([old(f"s{i}") for i in range(6)])

    def lose_the_lock() -> None:
        store.lock_alive = False

    store.before_delete = lose_the_lock
    with pytest.raises(StoreUnavailable):
        await purger(store, PurgeBounds(max_sessions=2, pause_s=0)).purge_idle(30)
    assert store.batches == [["s0", "s1"]]


async def test_stop_ends_a_pass_after_its_current_batch() -> None:
    store = MemoryStore([old(f"s{i}") for i in range(6)])
    running = purger(store, PurgeBounds(max_sessions=2, pause_s=0))
    store.before_delete = running.stop
    report = await running.purge_idle(30)
    assert report.stopped and store.batches == [["s0", "s1"]]


async def test_a_pass_another_process_runs_is_skipped() -> None:
    store = MemoryStore([old("a")])
    store.locked_elsewhere = True
    report = await purger(store).purge_idle(30)
    assert report.skipped and store.batches == []


async def test_an_erasure_needs_a_human() -> None:
    with pytest.raises(ValueError):
        await purger(MemoryStore([])).erase("  ")


async def test_the_job_reports_each_pass_in_the_metrics() -> None:
    metrics = Metrics()
    observer = PrometheusPurgeObserver(metrics)
    store = MemoryStore([old("a"), old("b")])
    job = RetentionJob(purger(store, observer=observer), 30, 3600, Clock(), observer)

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    # Zeros before anything happened: every series exists from the start.
    assert sample("ballet_planner_retention_sessions_deleted_total", reason="idle") == 0
    assert sample("ballet_planner_retention_passes_total", outcome="failed") == 0

    completed = await job.run_once()
    store.locked_elsewhere = True
    skipped = await job.run_once()
    store.locked_elsewhere = False
    store.fail_windows = True
    failed = await job.run_once()

    assert completed is not None and completed.sessions == 2
    assert skipped is not None and skipped.skipped
    assert failed is None
    assert sample("ballet_planner_retention_sessions_deleted_total", reason="idle") == 2
    assert sample("ballet_planner_retention_messages_deleted_total", reason="idle") == 4
    assert sample("ballet_planner_retention_sessions_deleted_total", reason="erasure") == 0
    for outcome in PassOutcome:
        assert sample("ballet_planner_retention_passes_total", outcome=outcome.value) == 1
    last = sample("ballet_planner_retention_last_completed_pass_timestamp_seconds")
    assert last == NOW.timestamp()
    assert PurgeReason.IDLE.value == "idle"


async def test_the_job_runs_a_pass_at_start_and_stops() -> None:
    passes = asyncio.Event()

    class Seen(PrometheusPurgeObserver):
        def pass_ended(self, outcome: PassOutcome, at: datetime) -> None:
            super().pass_ended(outcome, at)
            passes.set()

    observer = Seen(Metrics())
    store = MemoryStore([old("a")])
    job = RetentionJob(purger(store, observer=observer), 30, 3600, Clock(), observer)
    job.start()
    await asyncio.wait_for(passes.wait(), 5)
    await job.stop()
    assert store.batches == [["a"]]
    with pytest.raises(ValueError):
        RetentionJob(purger(store), 0, 3600, Clock())
