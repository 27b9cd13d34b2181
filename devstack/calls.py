"""The record of every backend call, for tests (README.md: "a record of every call's
human and actor that tests can read").

Kept in memory by the running ``DevStack``; nothing here touches the database, so reading
it never races the backends' transactions. Tests wait on it with ``wait_for`` (an
``asyncio.Condition``), never by sleeping.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class CallRecord:
    """One finished backend RPC.

    ``service`` is the full service name (``ballet.tracker.v1.TrackerService``), ``method``
    the RPC name (``GetItem``). ``human`` is the verified token subject (empty when the
    token was refused); ``actor`` the honoured ``x-ballet-actor`` (empty when absent or not
    honoured); ``actor_header`` the raw header (None when absent), so a test can see that a
    forged actor was sent and ignored. ``request_id`` is set for write RPCs. ``code`` and
    ``reason`` are the outcome (``reason`` is the ErrorInfo reason, empty on OK).
    ``start_time`` is seconds since the epoch; ``duration_s`` seconds.
    """

    service: str
    method: str
    human: str
    actor: str
    actor_header: str | None
    request_id: str
    project_id: str
    code: grpc.StatusCode
    reason: str
    start_time: float
    duration_s: float

    @property
    def actor_forged(self) -> bool:
        """True when an actor header was sent but not honoured."""
        return self.actor_header is not None and not self.actor


class CallLog:
    """Every call's record, in completion order, and the writes made per request id."""

    def __init__(self) -> None:
        self._records: list[CallRecord] = []
        self._started: Counter[str] = Counter()
        self._writes: Counter[str] = Counter()
        self._changed: asyncio.Condition | None = None

    @property
    def records(self) -> list[CallRecord]:
        """A copy of the records so far, oldest first."""
        return list(self._records)

    @property
    def writes(self) -> Mapping[str, int]:
        """How many times each ``request_id`` actually wrote (a replay does not count)."""
        return dict(self._writes)

    def started(self, method: str) -> int:
        """How many calls of ``method`` have started (finished or not)."""
        return self._started[method]

    def for_method(self, method: str) -> list[CallRecord]:
        """The records of one RPC name, e.g. ``ProposeChangeset``, oldest first."""
        return [record for record in self._records if record.method == method]

    def clear(self) -> None:
        """Forget every record and write count (between tests sharing one stack)."""
        self._records.clear()
        self._started.clear()
        self._writes.clear()

    def note_started(self, method: str) -> None:
        """Count a call of ``method`` as started and wake waiters."""
        self._started[method] += 1
        self._notify()

    def note_write(self, request_id: str) -> None:
        """Count one real write made for ``request_id`` (ignored when empty)."""
        if request_id:
            self._writes[request_id] += 1

    def add(self, record: CallRecord) -> None:
        """Append a finished call and wake waiters."""
        self._records.append(record)
        self._notify()

    async def wait_for(self, predicate: Callable[[CallLog], bool], timeout_s: float = 10.0) -> None:
        """Wait until ``predicate(self)`` holds; raises ``TimeoutError`` after ``timeout_s``."""
        condition = self._condition()
        async with asyncio.timeout(timeout_s), condition:
            await condition.wait_for(lambda: predicate(self))

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def _notify(self) -> None:
        condition = self._changed
        if condition is None:
            return

        # Called from the server's handlers on the same loop; waking waiters needs the
        # condition's lock, so it happens in a task rather than inline.
        async def wake() -> None:
            async with condition:
                condition.notify_all()

        task = asyncio.get_running_loop().create_task(wake())
        _pending.add(task)
        task.add_done_callback(_pending.discard)


# Strong references to the wake-up tasks until they finish (asyncio keeps only weak ones).
_pending: set[asyncio.Task[None]] = set()
