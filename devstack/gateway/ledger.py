"""The gateway's per-project usage ledger (README.md: "a per-project usage ledger
that tests can read").

One record per model call that finished (a call that failed produced no answer and is
not metered). Tokens are counted as the provider reported them; a call without reported
usage counts as a call with zero tokens and `usage=None` in its record.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import NamedTuple

from devstack.gateway.base import Usage


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One metered model call.

    `purpose` is "turn" or "compaction"; `model` is the request's model field (empty when
    the caller left the choice to the provider); `usage` is None when none was reported.
    """

    project_id: str
    credential_ref: str
    purpose: str
    model: str
    request_id: str
    usage: Usage | None


class UsageTotals(NamedTuple):
    """A project's totals: finished calls, input tokens, output tokens."""

    calls: int
    input_tokens: int
    output_tokens: int


class UsageLedger:
    """Usage records in arrival order, with per-project totals.

    Safe to use from the event loop and from other threads (a test reading while the
    devstack serves from another thread): every method holds one lock and never awaits.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[UsageRecord] = []
        self._totals: dict[str, UsageTotals] = {}

    def record(self, entry: UsageRecord) -> None:
        """Append one record and add it to its project's totals."""
        input_tokens = entry.usage.input_tokens if entry.usage else 0
        output_tokens = entry.usage.output_tokens if entry.usage else 0
        with self._lock:
            self._records.append(entry)
            calls, inp, out = self._totals.get(entry.project_id, UsageTotals(0, 0, 0))
            self._totals[entry.project_id] = UsageTotals(
                calls + 1, inp + input_tokens, out + output_tokens
            )

    def totals(self, project_id: str) -> UsageTotals:
        """`(calls, input_tokens, output_tokens)` of a project; zeros for an unknown one."""
        with self._lock:
            return self._totals.get(project_id, UsageTotals(0, 0, 0))

    @property
    def records(self) -> list[UsageRecord]:
        """A copy of every record, oldest first."""
        with self._lock:
            return list(self._records)

    def clear(self) -> None:
        """Forget every record (between tests sharing one devstack)."""
        with self._lock:
            self._records.clear()
            self._totals.clear()
