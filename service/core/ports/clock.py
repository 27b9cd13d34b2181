"""Clock port: wall-clock time for stored timestamps and leases, monotonic seconds for
deadlines and durations."""

from __future__ import annotations

from datetime import datetime
from typing import Protocol


class Clock(Protocol):
    """Wall-clock time for stored timestamps and leases; monotonic for deadlines."""

    def now(self) -> datetime: ...

    def monotonic(self) -> float: ...
