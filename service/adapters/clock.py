"""The ``Clock`` port on the machine's clocks: the one place outside tests where the
process's time comes from for the core (``service/core/ports/clock.py``)."""

from __future__ import annotations

import time
from datetime import UTC, datetime


class SystemClock:
    """``Clock`` on the machine's clocks: UTC wall time, monotonic seconds."""

    def now(self) -> datetime:
        """The current UTC time, timezone aware."""
        return datetime.now(UTC)

    def monotonic(self) -> float:
        """Seconds of a monotonic clock, for deadlines, durations and caches."""
        return time.monotonic()
