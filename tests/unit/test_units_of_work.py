"""The store's units of work run where no caller's cancellation reaches them (decision 0180):
``service.adapters.store.work``."""

from __future__ import annotations

import asyncio
import inspect
import logging

import pytest

from service.adapters.store.pg import PgSessionStore, PgStreamStore
from service.adapters.store.repository import SqlSessionStore
from service.adapters.store.retention import SqlRetentionStore
from service.adapters.store.streams import SqlStreamStore
from service.adapters.store.work import MARK, READ_MARK, UnitsOfWork
from service.core.errors import StoreUnavailable


@pytest.mark.parametrize(
    "store", [SqlSessionStore, PgSessionStore, SqlStreamStore, PgStreamStore, SqlRetentionStore]
)
def test_every_public_method_of_a_store_is_a_unit_of_work(store: type) -> None:
    """By construction, not by review: a method added without ``@unit_of_work`` (or an
    override that drops it) fails here."""
    methods = inspect.getmembers(store, inspect.iscoroutinefunction)
    missing = [name for name, method in methods if not name.startswith("_")]
    missing = [name for name in missing if not getattr(getattr(store, name), MARK, False)]
    assert missing == []


async def test_a_cancelled_caller_leaves_its_unit_of_work_to_finish() -> None:
    units = UnitsOfWork()
    release = asyncio.Event()
    finished: list[str] = []

    async def work() -> str:
        await release.wait()
        # What a unit does after its statement: commit, give the connection back.
        await asyncio.sleep(0)
        finished.append("returned")
        return "done"

    caller = asyncio.get_running_loop().create_task(units.run(work()))
    await asyncio.sleep(0)
    assert units.in_flight == 1
    caller.cancel()
    await asyncio.sleep(0)
    caller.cancel()  # a second cancellation, where the caller would be cleaning up
    await asyncio.wait({caller})
    assert caller.cancelled()
    assert finished == [] and units.in_flight == 1
    release.set()
    await units.drain(5)
    assert finished == ["returned"] and units.in_flight == 0


async def test_the_caller_gets_the_result_or_the_error() -> None:
    units = UnitsOfWork()

    async def fails() -> None:
        raise StoreUnavailable("down")

    async def answers() -> int:
        return 7

    assert await units.run(answers()) == 7
    with pytest.raises(StoreUnavailable):
        await units.run(fails())


async def test_drain_cancels_what_outlives_it_once() -> None:
    units = UnitsOfWork()
    unwound: list[str] = []

    async def hangs() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            # A rollback after the one cancellation drain sends.
            await asyncio.sleep(0)
            unwound.append("rolled back")
            raise

    caller = asyncio.get_running_loop().create_task(units.run(hangs()))
    await asyncio.sleep(0)
    caller.cancel()
    await units.drain(0)
    assert unwound == ["rolled back"] and units.in_flight == 0


async def test_a_bug_in_an_abandoned_unit_of_work_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    units = UnitsOfWork()
    go = asyncio.Event()

    async def bug() -> None:
        await go.wait()
        raise RuntimeError("a bug")

    async def down() -> None:
        await go.wait()
        raise StoreUnavailable("down")

    callers = [asyncio.get_running_loop().create_task(units.run(w())) for w in (bug, down)]
    await asyncio.sleep(0)
    for caller in callers:
        caller.cancel()
    go.set()
    with caplog.at_level(logging.ERROR):
        await units.drain(5)
        await asyncio.sleep(0)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "whose caller left failed" in errors[0].getMessage()


async def test_an_abandoned_read_is_cancelled_once_after_its_grace() -> None:
    units = UnitsOfWork(abandoned_read_grace_s=0.05)
    cancels: list[str] = []

    async def read() -> None:
        try:
            await asyncio.Event().wait()  # a statement behind a lock
        except asyncio.CancelledError:
            cancels.append("read")
            # What psycopg does on a cancel: ask the server, wait for its answer.
            await asyncio.sleep(0.1)
            raise

    caller = asyncio.ensure_future(units.run(read(), read=True))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert units.in_flight == 1
    await units.drain(1.0)  # the read is unwinding: drain does not cancel it again
    assert cancels == ["read"]
    assert units.in_flight == 0
    assert units.abandoned_reads_cancelled == 1


async def test_an_abandoned_write_runs_to_its_end() -> None:
    units = UnitsOfWork(abandoned_read_grace_s=0)
    release = asyncio.Event()
    done: list[str] = []

    async def write() -> None:
        await release.wait()
        done.append("committed")

    caller = asyncio.ensure_future(units.run(write()))
    await asyncio.sleep(0)
    caller.cancel()
    await asyncio.sleep(0.05)
    release.set()
    await units.drain(1.0)
    assert done == ["committed"]
    assert units.abandoned_reads_cancelled == 0


def test_the_stores_reads_are_marked() -> None:
    for store, name in [
        (PgSessionStore, "get_session"),
        (PgSessionStore, "ping"),
        (SqlSessionStore, "list_messages"),
        (SqlStreamStore, "count_streams"),
    ]:
        assert getattr(getattr(store, name), READ_MARK, False), (store, name)
    assert not getattr(SqlSessionStore.commit, READ_MARK, False)


async def test_a_unit_of_work_past_its_deadline_fails_unavailable_and_is_cancelled_once() -> None:
    """Decision 0310: whatever a unit waits for (a silent database), its caller gets
    ``StoreUnavailable`` at the deadline, and the unit is cancelled once, not twice."""
    units = UnitsOfWork(unit_timeout_s=0.05)
    kinds: list[str] = []
    units.on_failure(kinds.append)
    cancellations: list[str] = []
    release = asyncio.Event()

    async def stuck() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancellations.append("cancelled")
            # psycopg's own cleanup after a cancellation: it needs further awaits.
            await release.wait()
            raise

    with pytest.raises(StoreUnavailable, match=r"did not answer within 0\.05 s"):
        await units.run(stuck(), "commit")
    assert cancellations == ["cancelled"] and units.units_expired == 1
    assert kinds == ["unavailable"]
    assert units.in_flight == 1  # still cleaning up; drain does not cancel it again
    release.set()
    await units.drain(5)
    assert cancellations == ["cancelled"] and units.in_flight == 0


async def test_a_unit_whose_caller_left_still_ends_at_its_deadline() -> None:
    units = UnitsOfWork(unit_timeout_s=0.05)
    ended = asyncio.Event()

    async def stuck() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.set()

    caller = asyncio.get_running_loop().create_task(units.run(stuck()))
    await asyncio.sleep(0)
    caller.cancel()
    await asyncio.wait({caller})
    await asyncio.wait_for(ended.wait(), 5)
    assert units.units_expired == 1


async def test_a_unit_within_its_deadline_returns_its_result() -> None:
    units = UnitsOfWork(unit_timeout_s=5)

    async def work() -> str:
        await asyncio.sleep(0)
        return "done"

    assert await units.run(work()) == "done"
    assert units.units_expired == 0


async def _passes_after_the_end(units: UnitsOfWork) -> int:
    """The passes of the event loop from the end of a unit of work run by ``units`` to
    its caller going on."""
    passes = 0
    ended = 0

    async def count() -> None:
        nonlocal passes
        while True:
            passes += 1
            await asyncio.sleep(0)

    async def work() -> str:
        nonlocal ended
        await asyncio.sleep(0)
        ended = passes
        return "done"

    counter = asyncio.get_running_loop().create_task(count())
    try:
        assert await units.run(work()) == "done"
        return passes - ended
    finally:
        counter.cancel()


async def test_the_caller_goes_on_in_the_pass_after_its_unit_ends() -> None:
    """Decision 0398: the unit settles its caller's outcome as its last step, so the
    caller runs in the next pass of the event loop (with or without a deadline), not
    after the task's done callbacks have had a pass of their own."""
    assert await _passes_after_the_end(UnitsOfWork()) <= 1
    assert await _passes_after_the_end(UnitsOfWork(unit_timeout_s=5)) <= 1
